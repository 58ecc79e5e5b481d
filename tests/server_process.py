"""Real ``python -m app serve`` processes on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import httpx

STARTUP_TIMEOUT = 20.0
LOAD_TIMEOUT = 300.0  # seconds: importing torch and loading a model, on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)


@contextmanager
def running_server(
    *flags: str,
    env: dict[str, str] | None = None,
    stderr: Any = None,
    launcher: Sequence[str] = ("-m", "app", "serve"),
    preexec_fn: Callable[[], None] | None = None,
    startup_timeout: float = STARTUP_TIMEOUT,
) -> Iterator[ServerProcess]:
    """Start a server with ``flags`` on a free port; wait until /health is 200; kill it after.
    ``launcher``: the interpreter's arguments that start it (a test-only script takes the
    ``serve`` flags too, e.g. tests/hanging_server.py). ``preexec_fn`` runs in the child before
    it starts (e.g. to lower its file limit). ``startup_timeout``: seconds it may take to
    answer /health (a real model's load needs ``LOAD_TIMEOUT``)."""
    port = free_port()
    command = [
        sys.executable,
        *launcher,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]
    process = subprocess.Popen(
        command,
        env={**os.environ, **(env or {})},
        stdout=stderr,
        stderr=stderr,
        preexec_fn=preexec_fn,
    )
    server = ServerProcess(process, port)
    try:
        _wait_healthy(server, startup_timeout)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def _wait_healthy(server: ServerProcess, timeout: float = STARTUP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited early with {server.process.returncode}")
        try:
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # waiting for another process to bind: there is no event to await
    raise TimeoutError("server did not become healthy")


T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.02
) -> T:
    """Poll ``check`` until it returns something other than None/False (bounded): the other
    side is another process, so there is no event to await."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@contextmanager
def loading_server(
    *flags: str, stderr: IO[str] | None = None
) -> Iterator[tuple[ServerProcess, list[str]]]:
    """A server with ``flags``; yields it once ``/health`` has left the ``loading`` state, with
    every health status seen on the way (``ok``, ``loading``, ...)."""
    port = free_port()
    command = [sys.executable, "-m", "app", "serve", "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen([*command, *flags], env=dict(os.environ), stderr=stderr)
    server, seen = ServerProcess(process, port), list[str]()
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT
        while time.monotonic() < deadline and process.poll() is None:
            try:
                health = httpx.get(server.url + "/health", timeout=2.0)  # 200: an empty body
                status = "ok" if health.status_code == 200 else health.json()["status"]
            except httpx.TransportError:
                time.sleep(0.05)  # another process is binding: there is no event to await
                continue
            if not seen or seen[-1] != status:
                seen.append(status)
            if status != "loading":
                break
            time.sleep(0.05)  # the load runs in another process: poll its health
        assert process.poll() is None, f"server exited with {process.returncode}"
        yield server, seen
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
