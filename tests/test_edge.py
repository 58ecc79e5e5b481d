"""HTTP edge hardening (issue 15): attacks from outside against a real uvicorn process, each test
named after the attack it pins."""

from __future__ import annotations

import json
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import ServerProcess, running_server

WAIT = 10.0


def rss_kib(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def open_fds(server: ServerProcess) -> int:
    return len(list(Path(f"/proc/{server.process.pid}/fd").iterdir()))


def read_reply(sock: socket.socket, timeout: float = WAIT) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def error_of(reply: bytes) -> dict[str, Any]:
    body = reply.split(b"\r\n\r\n", 1)[1]
    error: dict[str, Any] = json.loads(body)["error"]
    return error


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerProcess]:
    flags = ("--max-header-bytes", "16384", "--header-timeout", "0.5", "--num-slots", "2")
    with running_server(*flags) as server:
        yield server


def test_header_bomb_gets_431_with_the_error_shape(guarded: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" + b"X-Pad: " + b"a" * 20_000 + b"\r\n")
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 431 ")
    assert error_of(reply)["code"] == "headers_too_large"


def test_header_bomb_of_20_mb_is_cut_off_without_growing_memory(guarded: ServerProcess) -> None:
    """The attack: 20 MB of small headers on one connection took the server from 52 to 455 MB
    of RSS, before any API-key check. Now the connection ends after the bound."""
    before = rss_kib(guarded)
    line = b"X-Header-Line: " + b"b" * 40 + b"\r\n"
    block = line * (64 * 1024 // len(line))
    sent = 0
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.settimeout(WAIT)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\n")
        with pytest.raises(OSError):  # reset or broken pipe: the server has closed
            while sent < 20 << 20:
                sock.sendall(block)
                sent += len(block)
    assert sent < 4 << 20
    assert rss_kib(guarded) - before < 8 * 1024
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_headers_just_under_the_bound_are_served(guarded: ServerProcess) -> None:
    response = httpx.get(guarded.url + "/health", headers={"x-pad": "c" * 15_000})
    assert response.status_code == 200


def test_slowloris_trickling_headers_is_closed_after_the_header_timeout(
    guarded: ServerProcess,
) -> None:
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        sock.settimeout(0.1)
        reply = b""
        while not reply and time.monotonic() - start < WAIT:
            try:
                sock.sendall(b"X")  # one byte at a time, as the attack does
                reply = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
        elapsed = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert error_of(reply)["code"] == "header_timeout"  # one small write: it came in one piece
    assert 0.4 < elapsed < 3.0


def test_a_silent_connection_is_closed_after_the_header_timeout(guarded: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")


def _limit_files(limit: int) -> Any:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


def test_slowloris_flood_past_the_file_limit_leaves_health_and_metrics_answering() -> None:
    """The attack: with a 1,024 file limit, 1,100 trickling connections made /health fail for
    everyone. Here with a 256 file limit (bound 128 + 32 for /health and /metrics) and 300
    connections that never finish their headers."""
    with running_server("--header-timeout", "60", preexec_fn=_limit_files(256)) as server:
        attackers = []
        try:
            for _ in range(300):
                sock = socket.create_connection(("127.0.0.1", server.port))
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
                attackers.append(sock)
            for path in ("/health", "/metrics", "/health"):
                assert httpx.get(server.url + path, timeout=WAIT).status_code == 200
            assert open_fds(server) < 256 - 32
            refused = httpx.post(server.url + "/generate", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "too_many_connections"
        finally:
            for sock in attackers:
                sock.close()


def _send_generate(sock: socket.socket, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip


def test_non_reading_streams_are_cut_off_after_little_unread_data_and_aborted() -> None:
    """The attack: clients that never read kept their slots for over 35 s with --send-timeout 2
    (the stall clock started only once about 1.5 MB sat in the kernel's send buffer), and a
    normal request queued behind them timed out; after the cut-off the socket stayed open with
    megabytes queued. Now a stream blocks after ~16 KiB unread on the server side, is cut off
    1-2 send timeouts later, and its connection is aborted, not flushed."""
    flags = ("--send-timeout", "0.5", "--mock-step-ms", "1", "--num-slots", "4",
             "--max-model-len", "10000000")  # fmt: skip
    with running_server(*flags) as server:
        readers = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        try:
            for sock in readers:
                _send_generate(sock, {"prompt": "x", "max_tokens": 9_000_000, "ignore_eos": True})
            queued = httpx.post(server.url + "/generate", timeout=30,
                                json={"prompt": "y", "max_tokens": 5, "stream": False})  # fmt: skip
            assert queued.status_code == 200
            deadline = time.monotonic() + WAIT  # another process: poll its slot table
            while any(
                slot["is_processing"] for slot in httpx.get(server.url + "/slots").json()["slots"]
            ):
                assert time.monotonic() < deadline, "a non-reading stream kept its slot"
                time.sleep(0.05)
            unread = [len(read_reply(sock, timeout=WAIT)) for sock in readers]  # then read
        finally:
            for sock in readers:
                sock.close()
        assert max(unread) < 384 * 1024, unread  # it was megabytes: the kernel's whole buffer
