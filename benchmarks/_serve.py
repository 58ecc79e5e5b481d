"""Shared by the benchmarks that drive servers with ``slotserve bench``: start a server process
on 127.0.0.1, run the bench tool against it as a separate process, read its JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's app/, not an installed one


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def started(command: Sequence[str], port: int, cwd: Path = ROOT,
            env: dict[str, str] | None = None, timeout: float = 30,
            output: int | None = None) -> Iterator[str]:  # fmt: skip
    """Run ``command`` (a server on ``port``), wait up to ``timeout`` s for /health, yield
    its URL, stop it. ``output``: where its stdout and stderr go (e.g. ``subprocess.DEVNULL``;
    None: inherited)."""
    process = subprocess.Popen(
        list(command), cwd=cwd, env={**ENV, **(env or {})}, stdout=output, stderr=output
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise SystemExit(f"server exited with {process.returncode}: {command}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"not healthy after {timeout} s: {command}") from None
            time.sleep(0.1)  # another process is binding: nothing to await
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def slotserve(*flags: str) -> Iterator[str]:
    """``python -m app serve`` of this checkout with ``flags``."""
    port = free_port()
    command = [sys.executable, "-m", "app", "serve", "--port", str(port),
               "--log-level", "warning", *flags]  # fmt: skip
    with started(command, port) as url:
        yield url


def bench(url: str, *args: str) -> dict[str, Any]:
    """Run ``python -m app bench --url URL ARGS`` and return its JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "app", "bench", "--url", url, "--no-progress",
                   "--json", str(out), *args]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench failed ({done.returncode}): {done.stderr.strip()}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def engine_commit() -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes to app/)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "app"], cwd=ROOT).returncode
    return head + ("-dirty" if dirty else "")
