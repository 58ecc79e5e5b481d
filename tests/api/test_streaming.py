"""The SSE response's stalled-reader watchdog, driven at the ASGI level with a fake client: a
reader that is slow but keeps taking events is left alone; one that stops is cut off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sse_starlette.sse import AppStatus

from app.api.streaming import CHECKPOINT_SENDS, EventStream

STALL_TIMEOUT = 0.05  # the tests synchronise on its wake-ups, not on durations
EVENTS = [f"data: {i}\n\n".encode() for i in range(6)]
SCOPE = {"type": "http", "method": "POST", "path": "/generate", "headers": []}


async def events() -> AsyncIterator[bytes]:
    for event in EVENTS:
        yield event


async def never_disconnects() -> dict[str, str]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def serve(reader: str) -> tuple[list[bytes], bool, int]:
    """Run one stream against a client that reads as ``reader`` says: ``"slow"`` takes each
    event only once the watchdog has woken up while its send was pending (the slowest reader
    that keeps reading: every send spans a wake-up), ``"stopped"`` never takes the second one.
    Returns the events taken, whether on_close ran, and the watchdog's wake-ups."""
    AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]
    taken: list[bytes] = []
    closed = asyncio.Event()
    wakeup = asyncio.Event()  # set at the watchdog's next wake-up (then replaced)
    wakeups = 0
    response = EventStream(events(), stall_timeout=STALL_TIMEOUT, ping=600, on_close=closed.set)
    watch = response._watch

    def counting_watch(loop: asyncio.AbstractEventLoop, pending_send: int) -> None:
        nonlocal wakeup, wakeups
        wakeups += 1
        watch(loop, pending_send)
        wakeup.set()
        wakeup = asyncio.Event()

    response._watch = counting_watch  # type: ignore[method-assign]

    async def send(message: dict[str, object]) -> None:
        body = message.get("body")
        if not isinstance(body, bytes) or not body:
            return
        if reader == "stopped" and taken:
            await asyncio.Event().wait()  # the reader stopped reading
        if reader == "slow":
            await wakeup.wait()
        taken.append(body)

    await asyncio.wait_for(response(SCOPE, never_disconnects, send), timeout=10)  # type: ignore[arg-type]
    return taken, closed.is_set(), wakeups


async def test_a_slow_reader_that_keeps_reading_gets_every_event() -> None:
    """Every send is still pending at one watchdog wake-up (so the stream lasts several stall
    timeouts), but none at two: the reader is slow, not stalled, and is never cut off."""
    taken, closed, wakeups = await serve("slow")
    assert taken == EVENTS and closed
    assert wakeups >= len(EVENTS)


async def test_a_reader_that_stops_reading_is_cut_off_and_its_request_closed() -> None:
    taken, closed, _ = await serve("stopped")
    assert taken == EVENTS[:1] and closed


async def test_a_disconnect_ends_a_stream_whose_events_never_suspend() -> None:
    """Events already buffered (n > 1 choices, a fast model) are produced without suspending,
    and after a disconnect the server's send is a no-op that does not suspend either: the
    stream must still end within a few events, not after the last one (the requests behind
    it kept decoding to the end)."""
    AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]
    sent = asyncio.Event()
    pulled_after = 0
    closed = asyncio.Event()

    async def plenty() -> AsyncIterator[bytes]:
        nonlocal pulled_after
        for i in range(10_000):
            if sent.is_set():
                pulled_after += 1
            yield f"data: {i}\n\n".encode()

    async def receive() -> dict[str, str]:
        await sent.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        if message.get("body"):
            sent.set()  # then the client leaves; later sends return at once (as uvicorn's)

    response = EventStream(plenty(), stall_timeout=600, ping=600, on_close=closed.set)
    await asyncio.wait_for(response(SCOPE, receive, send), timeout=10)  # type: ignore[arg-type]
    assert closed.is_set()
    assert pulled_after < 4 * CHECKPOINT_SENDS
