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
from typing import Any, TypeVar

import httpx

STARTUP_TIMEOUT = 20.0


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
    it starts (e.g. to lower its file limit). ``startup_timeout``: seconds until healthy (a real
    model loads for longer than the mock)."""
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


def _wait_healthy(server: ServerProcess, timeout: float) -> None:
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
