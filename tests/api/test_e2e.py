"""End to end: a real uvicorn process on 127.0.0.1 and real clients (httpx, openai)."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
from server_process import ServerProcess, running_server
from sse import parse_sse

LONG = {"prompt": "Tell me everything ", "max_tokens": 8000, "ignore_eos": True}
WAIT = 10.0  # upper bound for anything that should happen within a few steps


async def next_event(lines: AsyncIterator[str]) -> tuple[str, str]:
    """The next (event, data) of an SSE body read line by line."""
    event, data = "message", ""
    async for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
        elif not line and data:
            return event, data
    raise EOFError("stream ended")


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = WAIT) -> None:
    """Wait for another process's state to change (there is no event to await across it)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


async def slots(client: httpx.AsyncClient) -> dict[str, Any]:
    table: dict[str, Any] = (await client.get("/slots")).json()
    return table


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def one_slot() -> Any:
    with running_server("--num-slots", "1", "--max-waiting", "1", "--mock-step-ms", "5") as server:
        yield server


async def test_closing_a_stream_frees_its_slot_for_the_queued_request(
    one_slot: ServerProcess,
) -> None:
    async with (
        httpx.AsyncClient(base_url=one_slot.url, timeout=WAIT) as a,
        httpx.AsyncClient(base_url=one_slot.url, timeout=WAIT) as b,
    ):
        aborts = await aborted(a)  # the module's server is shared: count from here
        async with a.stream("POST", "/generate", json=LONG) as first:
            lines = first.aiter_lines()  # keep a reference: a collected iterator closes the stream
            assert (await next_event(lines))[0] == "token"
            queued = b.build_request("POST", "/generate", json={"prompt": "next ", "max_tokens": 3})
            second = asyncio.create_task(b.send(queued, stream=True))
            await eventually(lambda: _waiting_is(a, 1))
        # the first client has closed its connection: its slot goes to the queued request
        response = await asyncio.wait_for(second, WAIT)
        events = parse_sse((await response.aread()).decode())
        assert events[-1].event == "done" and events[-1].data["finish_reason"] == "length"
        assert await aborted(a) == aborts + 1  # the closed stream's request, nothing else


async def test_disconnecting_a_non_streamed_request_frees_its_slot(one_slot: ServerProcess) -> None:
    async with (
        httpx.AsyncClient(base_url=one_slot.url, timeout=WAIT) as a,
        httpx.AsyncClient(base_url=one_slot.url, timeout=WAIT) as b,
    ):
        blocking = asyncio.create_task(a.post("/generate", json=LONG | {"stream": False}))
        await eventually(lambda: _running_is(b, 1))
        blocking.cancel()  # closes the connection mid-request
        with pytest.raises(asyncio.CancelledError):
            await blocking
        r = await b.post("/generate", json={"prompt": "x", "max_tokens": 3, "stream": False})
        assert r.status_code == 200 and r.json()["finish_reason"] == "length"


async def test_a_queued_request_whose_client_left_never_runs(one_slot: ServerProcess) -> None:
    async with (
        httpx.AsyncClient(base_url=one_slot.url, timeout=WAIT) as a,
        httpx.AsyncClient(base_url=one_slot.url, timeout=WAIT) as b,
    ):
        await eventually(lambda: _idle(a))  # a previous test's aborts are applied
        before = (await a.get("/metrics")).text
        async with a.stream("POST", "/generate", json=LONG | {"request_id": "holder"}) as first:
            lines = first.aiter_lines()
            await next_event(lines)
            async with b.stream("POST", "/generate", json={"prompt": "q", "max_tokens": 5}):
                await eventually(lambda: _waiting_is(a, 1))
            await eventually(lambda: _waiting_is(a, 0))
            assert (await slots(a))["slots"][0]["request_id"] == "holder"
        await eventually(lambda: _idle(a))  # the holder's abort is applied too
        after = (await a.get("/metrics")).text
        zero = "vllm:request_generation_tokens_bucket"
        # the queued request ended (abort) with no token generated: it never reached the model
        assert metric(after, zero, le="1.0") - metric(before, zero, le="1.0") == 1


async def test_overload_is_429_with_retry_after_at_once(one_slot: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=one_slot.url, timeout=WAIT) as client:
        async with client.stream("POST", "/generate", json=LONG) as first:
            lines = first.aiter_lines()
            await next_event(lines)
            async with client.stream("POST", "/generate", json=LONG):
                await eventually(lambda: _waiting_is(client, 1))
                # answered at once, not queued: a queued request would wait for the 8,000-token
                # request ahead of it (40 s, past the client's timeout) and then get 200
                r = await client.post("/generate", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.headers["x-slotserve-error-code"] == "queue_full"


async def aborted(client: httpx.AsyncClient) -> float:
    """Requests ended with ``abort`` so far, read once the server is idle (every abort that a
    closed connection posted has been applied)."""
    await eventually(lambda: _idle(client))
    return metric((await client.get("/metrics")).text, "vllm:request_success_total",
                  finished_reason="abort")  # fmt: skip


async def _idle(client: httpx.AsyncClient) -> bool:
    table = await slots(client)
    return bool(table["running"] == 0 and table["waiting"] == 0)


async def _waiting_is(client: httpx.AsyncClient, n: int) -> bool:
    return bool((await slots(client))["waiting"] == n)


async def _running_is(client: httpx.AsyncClient, n: int) -> bool:
    return bool((await slots(client))["running"] == n)


def test_sigterm_drains_then_exits(tmp_path: Any) -> None:
    grace = 1.0
    log = (tmp_path / "server.log").open("wb")
    flags = ("--shutdown-grace", str(grace), "--mock-step-ms", "10", "--num-slots", "4")
    with running_server(*flags, stderr=log) as server:
        asyncio.run(_drain_scenario(server, grace))
        log.close()
    output = (tmp_path / "server.log").read_text()
    assert "Task was destroyed but it is pending" not in output
    assert "Traceback" not in output


async def _drain_scenario(server: ServerProcess, grace: float) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT) as client:
        async with (
            client.stream("POST", "/generate", json=LONG) as long,
            client.stream(
                "POST", "/generate", json={"prompt": "s", "max_tokens": 20, "ignore_eos": True}
            ) as short,
        ):
            long_lines, short_lines = long.aiter_lines(), short.aiter_lines()
            await next_event(long_lines)
            await next_event(short_lines)
            signalled = time.monotonic()
            server.terminate()
            await eventually(lambda: _status_is(client, "/health", 503))
            refused = await client.post("/generate", json={"prompt": "late"})
            assert (
                refused.status_code == 503
                and refused.headers["x-slotserve-error-code"] == "draining"
            )
            assert await _last_event(short_lines) == ("done", "length")  # finished within grace
            assert await _last_event(long_lines) == ("done", "abort")  # cut at the end of grace
            assert time.monotonic() - signalled >= grace * 0.9
    await asyncio.to_thread(server.wait_exit, grace + 2.0)
    assert time.monotonic() - signalled < grace + 2.0


async def _last_event(lines: AsyncIterator[str]) -> tuple[str, str]:
    event: tuple[str, str] = ("", "")
    try:
        while True:
            event = await next_event(lines)
    except EOFError:
        pass
    name, data = event
    return name, re.search(r'"finish_reason":"(\w+)"', data).group(1)  # type: ignore[union-attr]


async def _status_is(client: httpx.AsyncClient, path: str, status: int) -> bool:
    return (await client.get(path)).status_code == status


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    log_path = tmp_path_factory.mktemp("keyed") / "server.log"
    with (
        log_path.open("wb") as log,
        running_server(
            "--api-key", "k-123", "--num-slots", "8", "--log-level", "debug", stderr=log
        ) as server,
    ):
        server.log_path = log_path  # type: ignore[attr-defined]
        yield server


async def test_the_api_key_never_appears_in_logs(keyed: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=WAIT) as client:
        auth = {"authorization": "Bearer k-123"}
        r = await client.post("/generate", json={"prompt": "x", "max_tokens": 3}, headers=auth)
        assert r.status_code == 200
        assert (
            await client.get("/slots", headers={"authorization": "Bearer no"})
        ).status_code == 401
    log = keyed.log_path.read_text()  # type: ignore[attr-defined]
    assert "POST /generate" in log  # the log is there and has seen the request
    assert "k-123" not in log


async def test_openai_client_completions_and_chat_streaming_and_not(keyed: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=keyed.url + "/v1", api_key="k-123", max_retries=0)
    (model,) = [m.id async for m in client.models.list()]
    whole = await client.completions.create(model=model, prompt="Once upon ", max_tokens=40)
    assert whole.choices[0].text and whole.usage is not None
    pieces = [c.choices[0].text async for c in await client.completions.create(
        model=model, prompt="Once upon ", max_tokens=40, stream=True) if c.choices]  # fmt: skip
    assert "".join(pieces) == whole.choices[0].text
    chat = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=30
    )
    reply = chat.choices[0].message.content
    assert reply and chat.choices[0].finish_reason in ("stop", "length")
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert chunks[-1].usage is not None and chat.usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=keyed.url + "/v1", api_key="wrong").models.list()
    await client.close()


def test_schemathesis_finds_no_server_error() -> None:
    with running_server("--num-slots", "16", "--max-model-len", "512") as server:
        result = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
             "--checks", "not_a_server_error", "--max-examples", "25", "--request-timeout", "20",
             "--generation-database", "none", "--seed", "1"],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]


def test_a_stalled_reader_is_cut_off_with_one_info_line_not_an_error(tmp_path: Any) -> None:
    """A client that stops reading (its receive window is full) is cut off after the send
    timeout and its slot freed. The server says so once, at INFO; uvicorn's "ASGI callable
    returned without completing response" error would page someone for a client's behaviour."""
    log_path = tmp_path / "server.log"
    # A 4,000-character model name makes every chunk 4 KB: the socket buffers fill quickly.
    flags = ("--send-timeout", "0.3", "--max-model-len", "10000000", "--log-level", "info",
             "--model-name", "m" * 4000)  # fmt: skip
    with log_path.open("wb") as log, running_server(*flags, stderr=log) as server:
        body = b'{"prompt": "x", "max_tokens": 9000000, "ignore_eos": true, "stream": true}'
        with socket.socket() as sock:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVBUF, 4096
            )  # before connect: small window
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            deadline = time.monotonic() + 30  # the reader never reads: wait for the cut-off
            while "reader stalled" not in log_path.read_text():
                assert time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.05)
            # The line is logged as the stream is cut off, before its abort reaches the engine:
            # wait for the slot itself to be freed.
            while any(s["is_processing"] for s in httpx.get(f"{server.url}/slots").json()["slots"]):
                assert time.monotonic() < deadline, "the stalled request's slot was never freed"
                time.sleep(0.02)
    text = log_path.read_text()
    assert text.count("reader stalled") == 1
    assert "ASGI callable returned without completing response" not in text
