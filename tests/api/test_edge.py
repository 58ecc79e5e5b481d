"""HTTP edge hardening (issue 15): attacks from outside against a real uvicorn process, each test
named after the attack it pins."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ClientFactory, serving_of
from server_process import ServerProcess, running_server

from app.engine.types import Sequence
from app.serving import GenerationParams, Serving

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
    assert error_of(reply)["code"] == 431
    assert b"x-slotserve-error-code: headers_too_large\r\n" in reply


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


def test_pipelined_requests_past_the_bound_together_are_each_served(
    guarded: ServerProcess,
) -> None:
    """Found in review: requests pipelined in one write whose sum passed the bound got a
    false 431, and the first request's answer was lost."""
    one = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"p" * 9_000 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.settimeout(WAIT)
        sock.sendall(one * 3)  # 27 KB in one write against a 16 KiB bound
        received = b""
        while received.count(b"HTTP/1.1 ") < 3:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    assert received.count(b"HTTP/1.1 200 ") == 3 and b" 431 " not in received


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
    assert error_of(reply)["code"] == 408
    assert (
        b"x-slotserve-error-code: header_timeout\r\n" in reply
    )  # one small write: it came in one piece
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
            assert refused.headers["x-slotserve-error-code"] == "too_many_connections"
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


def _serve_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "app", "serve", "--port", "0", *flags]


@pytest.mark.parametrize(
    ("flags", "env", "says"),
    [
        ((), {"SLOTSERVE_API_KEY": ""}, "is empty"),
        (("--api-key", ""), {}, "is empty"),
        (("--api-key", "alice: "), {}, "is empty"),
        (("--api-key", "clé-secrète"), {}, "outside printable ASCII"),
        (("--api-key", "a:k1", "--api-key", "a:k2"), {}, "given twice"),
    ],
)
def test_empty_or_non_ascii_api_key_refuses_to_start_with_one_line_error(
    flags: tuple[str, ...], env: dict[str, str], says: str
) -> None:
    """The attack (a careless operator): SLOTSERVE_API_KEY="" started a server that admitted
    "Authorization: Bearer" with nothing after it, while logging "api key set"."""
    result = subprocess.run(
        _serve_command(*flags), env={**os.environ, **env}, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert says in last and "--api-key" in last
    assert "clé" not in result.stderr and "k1" not in result.stderr


@pytest.fixture(scope="module")
def named_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys_file.write_text("# team keys\nbob:k-bob-3\n\n  carol:k-carol-4  \n")
    log_path = keys_file.with_name("server.log")
    flags = ("--api-key", "alice:k-alice-1", "--api-key", "k-default-2", "--api-keys-file",
             str(keys_file), "--log-level", "info")  # fmt: skip
    env = {"SLOTSERVE_API_KEY": "ignored:because-the-flag-wins"}
    with log_path.open("wb") as log, running_server(*flags, env=env, stderr=log) as server:
        server.log_path = log_path  # type: ignore[attr-defined]
        yield server


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_named_keys_from_flags_and_file_label_metrics_and_logs_by_name_never_key(
    named_keys: ServerProcess,
) -> None:
    url = named_keys.url
    body = {"prompt": "x", "max_tokens": 2, "stream": False}
    for key in ("k-alice-1", "k-default-2", "k-bob-3", "k-carol-4"):
        assert httpx.post(url + "/generate", json=body, headers=_bearer(key)).status_code == 200
    wrong = [_bearer(k) for k in ("because-the-flag-wins", "k-alice-1 extra", "k-bob")]
    for headers in [*wrong, {"authorization": "Bearer"}, {"authorization": "k-bob-3"}, {}]:
        assert httpx.post(url + "/generate", json=body, headers=headers).status_code == 401
    metrics = httpx.get(url + "/metrics").text
    for name in ("alice", "default", "bob", "carol"):
        assert f'finished_reason="length",key="{name}"' in metrics
    log = named_keys.log_path.read_text()  # type: ignore[attr-defined]
    assert "key=alice " in log and "api keys: alice, default, bob, carol" in log
    assert "k-alice-1" not in log and "k-bob-3" not in log and "k-default-2" not in log


def test_a_key_from_a_secret_file_with_a_trailing_newline_still_matches() -> None:
    with running_server(env={"SLOTSERVE_API_KEY": " k-newline\n"}) as server:
        reply = httpx.get(server.url + "/v1/models", headers=_bearer("k-newline"))
        assert reply.status_code == 200


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/slots", "/v1/models"])
def test_docs_and_schema_are_not_open_without_the_key(named_keys: ServerProcess, path: str) -> None:
    assert httpx.get(named_keys.url + path).status_code == 401
    assert httpx.get(named_keys.url + path, headers=_bearer("k-bob-3")).status_code == 200


def test_health_and_metrics_stay_open_with_keys(named_keys: ServerProcess) -> None:
    assert httpx.get(named_keys.url + "/health").status_code == 200
    assert httpx.get(named_keys.url + "/metrics").status_code == 200


DEEP = b'{"prompt": "x", "max_tokens": 1, "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
BAD_UTF8 = b'{"prompt": "\xff\xfe", "max_tokens": 1}'


@pytest.mark.parametrize("content", [BAD_UTF8, DEEP], ids=["invalid_utf8", "deep_nesting"])
def test_an_unparseable_body_without_a_key_gets_401_first_then_json_invalid(
    named_keys: ServerProcess, content: bytes
) -> None:
    headers = {"content-type": "application/json"}
    anonymous = httpx.post(named_keys.url + "/generate", content=content, headers=headers)
    assert anonymous.status_code == 401
    assert anonymous.headers["x-slotserve-error-code"] == "invalid_api_key"
    authorised = httpx.post(named_keys.url + "/generate", content=content,
                            headers=headers | _bearer("k-alice-1"))  # fmt: skip
    assert authorised.status_code == 400
    assert authorised.headers["x-slotserve-error-code"] == "json_invalid"


def threads(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads")


@pytest.fixture(scope="module")
def stepped() -> Iterator[ServerProcess]:
    with running_server("--mock-step-ms", "50", "--num-slots", "4") as server:
        yield server


async def test_request_id_reuse_right_after_delete_is_accepted(stepped: ServerProcess) -> None:
    """The bug: DELETE answered ``cancelled: true`` but re-submitting the same id at once got
    409, 30 times out of 30 with 50 ms steps. DELETE now answers once the abort is applied."""
    long = {"prompt": "x", "max_tokens": 8000, "ignore_eos": True, "request_id": "reused"}
    again = {"prompt": "x", "max_tokens": 1, "request_id": "reused", "stream": False}
    async with httpx.AsyncClient(base_url=stepped.url, timeout=WAIT) as client:
        for _ in range(10):
            async with client.stream("POST", "/generate", json=long) as stream:
                assert stream.status_code == 200
                await anext(stream.aiter_lines())  # the request is running
                deleted = await client.delete("/requests/reused")
                assert deleted.json() == {"request_id": "reused", "cancelled": True}
                assert (await client.post("/generate", json=again)).status_code == 200


async def test_a_burst_of_requests_does_not_grow_the_thread_pool() -> None:
    """The bug: two plain (non-async) dependencies ran in the thread pool on every request, so
    a burst took the server from 7 to 46 threads."""
    with running_server("--num-slots", "64", "--max-waiting", "256") as server:
        before = threads(server)
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            body = {"prompt": "x", "max_tokens": 4, "stream": False}
            replies = await asyncio.gather(*(client.post("/generate", json=body)
                                             for _ in range(50)))  # fmt: skip
            replies += await asyncio.gather(*(client.get("/v1/models") for _ in range(50)))
        assert all(reply.status_code == 200 for reply in replies)
        assert threads(server) <= before + 1


async def test_the_key_name_is_the_requests_user_and_the_user_field_is_used_without_keys(
    make_client: ClientFactory,
) -> None:
    """A later per-user fairness policy reads ``GenerationParams.user``: the authenticated
    key's name when keys are configured (a client cannot claim another user), else the
    client's own ``user`` field (native or OpenAI)."""
    seen: list[str | None] = []

    def spy(serving: Serving) -> None:
        prepare = serving.prepare  # every route builds its request here (app/api/faults.py)

        def recording(
            params: GenerationParams, id_prefix: str = "gen", fork_of: Sequence | None = None
        ) -> Sequence:
            seen.append(params.user)
            return prepare(params, id_prefix, fork_of)

        serving.prepare = recording  # type: ignore[method-assign]

    native = {"prompt": "x", "max_tokens": 1, "stream": False, "user": "mallory"}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "user": "mallory"}
    async with make_client(api_key=["alice:k-a"]) as client:
        spy(serving_of(client))
        headers = _bearer("k-a")
        assert (await client.post("/generate", json=native, headers=headers)).status_code == 200
        reply = await client.post("/v1/chat/completions", json=chat, headers=headers)
        assert reply.status_code == 200
    async with make_client() as client:
        spy(serving_of(client))
        assert (await client.post("/generate", json=native)).status_code == 200
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    assert seen == ["alice", "alice", "mallory", "mallory"]


async def test_a_flood_past_the_connection_bound_evicts_slowloris_not_running_streams() -> None:
    """Past the bound and its headroom, a new connection closes the one waiting longest for
    its headers. A stream being sent has finished its headers: it must never be the one."""
    with running_server("--max-connections", "4", "--header-timeout", "60",
                        "--mock-step-ms", "5") as server:  # fmt: skip
        long = {"prompt": "x", "max_tokens": 8000, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT) as client:
            async with client.stream("POST", "/generate", json=long) as stream:
                lines = stream.aiter_lines()
                await anext(lines)  # the stream is running
                attackers = []
                try:
                    for _ in range(80):  # 4 + 32 headroom, then evictions
                        sock = socket.create_connection(("127.0.0.1", server.port))
                        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
                        attackers.append(sock)
                    assert (await client.get("/health")).status_code == 200
                    for _ in range(50):  # the stream still flows
                        assert await anext(lines) is not None
                    assert read_reply(attackers[0]).startswith(b"HTTP/1.1 408 ")
                finally:
                    for sock in attackers:
                        sock.close()
