"""Server-sent events and client-disconnect handling shared by every generation route."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from app.engine.stream import RequestStream
from app.serving import Serving

T = TypeVar("T")
log = logging.getLogger("slotserve.api")


def sse_event(event: str | None, data: Any) -> bytes:
    """One encoded SSE event (built here, not by sse-starlette, to keep the hot path lean)."""
    payload = json.dumps(data, separators=(",", ":"))
    if event is None:
        return f"data: {payload}\n\n".encode()
    return f"event: {event}\ndata: {payload}\n\n".encode()


class EventStream(EventSourceResponse):
    """An SSE response for which a reader too slow to take a send within ``send_timeout`` is
    an expected outcome (logged, the request aborted by ``guarded``), not a server error."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            log.info("cancelled a stream whose reader stalled for %.1f s", self.send_timeout)


def sse_response(events: AsyncIterator[bytes], serving: Serving) -> EventSourceResponse:
    """Stream ``events``. sse-starlette watches for the client's ``http.disconnect`` and closes
    the generator (whose ``finally`` aborts the request); a send blocked longer than
    ``send_timeout`` does the same, so a reader that stops reading frees its slot."""
    settings = serving.settings
    return EventStream(
        events, ping=settings.sse_ping_seconds, send_timeout=settings.send_timeout, sep="\n"
    )


async def guarded(
    stream: RequestStream, serving: Serving, events: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """Yield ``events``; whatever ends the iteration early (disconnect, send timeout,
    cancellation) aborts the request so its slot is freed."""
    try:
        async for chunk in events:
            yield chunk
    finally:
        if stream.seq.finish_reason is None:
            serving.abort(stream.request_id)


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone (the body has already been read by then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client closed the connection before its non-streamed result was ready."""


async def until_disconnected(
    request: Request, work: Awaitable[T], abort: Callable[[], object]
) -> T:
    """Await ``work``; if the client disconnects first, call ``abort`` and raise ``ClientGone``.
    Listens on ``receive()`` for ``http.disconnect`` (works under any pure-ASGI middleware)."""
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({watcher, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not task.done()
        if gone:
            abort()
            task.cancel()
    if gone:
        raise ClientGone(request.url.path)
    return task.result()
