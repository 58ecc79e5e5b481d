"""The SSE response's stalled-reader watchdog, driven at the ASGI level with a fake client: a
reader that is slow but keeps taking events is left alone; one that stops is cut off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sse_starlette.sse import AppStatus

from app.api.streaming import EventStream

STALL_TIMEOUT = 0.2
EVENTS = [f"data: {i}\n\n".encode() for i in range(6)]
SCOPE = {"type": "http", "method": "POST", "path": "/generate", "headers": []}


async def events() -> AsyncIterator[bytes]:
    for event in EVENTS:
        yield event


async def never_disconnects() -> dict[str, str]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def serve(send_delay: float | None) -> tuple[list[bytes], bool]:
    """Run one stream against a client that takes each event after ``send_delay`` seconds, or
    never takes the second one (None). Returns the events taken and whether on_close ran."""
    AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]
    taken: list[bytes] = []
    closed = asyncio.Event()

    async def send(message: dict[str, object]) -> None:
        body = message.get("body")
        if not isinstance(body, bytes) or not body:
            return
        if send_delay is None and taken:
            await asyncio.Event().wait()  # the reader stopped reading
        await asyncio.sleep(send_delay or 0)
        taken.append(body)

    response = EventStream(events(), stall_timeout=STALL_TIMEOUT, ping=600, on_close=closed.set)
    await asyncio.wait_for(response(SCOPE, never_disconnects, send), timeout=5)  # type: ignore[arg-type]
    return taken, closed.is_set()


async def test_a_slow_reader_that_keeps_reading_gets_every_event() -> None:
    # Each send takes a quarter of the stall timeout; the whole stream takes longer than it.
    taken, closed = await serve(send_delay=STALL_TIMEOUT / 4)
    assert taken == EVENTS and closed


async def test_a_reader_that_stops_reading_is_cut_off_and_its_request_closed() -> None:
    taken, closed = await serve(send_delay=None)
    assert taken == EVENTS[:1] and closed
