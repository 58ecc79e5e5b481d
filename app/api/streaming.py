"""Server-sent events and client-disconnect handling shared by every generation route."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from app.api.connection import EXTENSION

T = TypeVar("T")
NO_SEND = -1  # the watchdog saw no send pending
CHECKPOINT_SENDS = 16  # a stream suspends at least once per this many sends (see EventStream)
MIN_PROGRESS_BYTES = 1024  # a reader taking less than this per --send-timeout has stalled
log = logging.getLogger("slotserve.api")


def sse_event(event: str | None, data: Any) -> bytes:
    """One encoded SSE event (built here, not by sse-starlette, to keep the hot path lean)."""
    payload = json.dumps(data, separators=(",", ":"))
    if event is None:
        return f"data: {payload}\n\n".encode()
    return f"event: {event}\ndata: {payload}\n\n".encode()


class EventStream(EventSourceResponse):
    """An SSE response that cancels a reader which stops reading.

    sse-starlette's own ``send_timeout`` arms a cancel scope around every send, which costs
    about 10 us per event. Here a send costs two attribute writes: a watchdog wakes once per
    ``stall_timeout`` and cancels the send only if the same send was already pending at its
    previous wake-up, so a stalled reader is cut off after 1-2x ``stall_timeout``. Cutting it
    off closes the event generator (which aborts the request and frees its slot) and is logged
    as an expected outcome, not a server error.

    ``on_close`` runs however the response ends (finished, client gone, stalled, cancelled, even
    before the first event), so the request behind the stream is never left running. Every
    ``CHECKPOINT_SENDS``-th send, and every send once the client is gone, is followed by a
    suspension point: events already buffered (n choices, a fast model) and a send that does not
    suspend (the server's send is a no-op after a disconnect) would otherwise keep the stream
    from ever letting the disconnect watcher run or its cancellation in, and the requests behind
    it would decode to their end.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        stall_timeout: float,
        ping: float,
        on_close: Callable[[], object],
    ) -> None:
        super().__init__(content, ping=ping, sep="\n")
        self.stall_timeout = stall_timeout
        self.on_close = on_close
        self._sender: asyncio.Task[Any] | None = None  # the task inside a send, if any
        self._sends = 0
        self._stalled = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._transport: Any = None  # the connection's transport, where the server exposes it
        self._buffered: int | None = None  # its write buffer at the previous wake-up

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = False

        async def watched_receive() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def watched_send(message: Message) -> None:
            self._sender = asyncio.current_task()
            await send(message)
            self._sender = None
            self._sends += 1
            if gone or not self._sends % CHECKPOINT_SENDS:
                await asyncio.sleep(0)  # a suspension point (see the class docstring)

        loop = asyncio.get_running_loop()
        self._transport = scope.get("extensions", {}).get(EXTENSION, {}).get("transport")
        self._watchdog = loop.call_later(self.stall_timeout, self._watch, loop, NO_SEND)
        try:
            await super().__call__(scope, watched_receive, watched_send)
        except BaseException as err:
            if not self._stalled or not _is_cancellation(err):
                raise
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
            if self._stalled:
                CUT_OFF.set(True)  # for HideCutOffResponses: this task returns mid-response
                log.info("cut off a stream whose reader stalled for %.1f s", self.stall_timeout)
                if self._transport is not None:  # at once: a graceful close would wait for
                    self._transport.abort()  # unread data that a stalled reader never takes
            self.on_close()

    def _watch(self, loop: asyncio.AbstractEventLoop, pending_send: int) -> None:
        """Wake-up every ``stall_timeout``. ``pending_send`` is the number of the send that
        was pending at the previous wake-up (``NO_SEND`` if none was): if that same send is
        still pending now and the reader took fewer than ``MIN_PROGRESS_BYTES`` of it meanwhile,
        the reader has stalled for a whole period, so cut it off."""
        sender = self._sender
        took_bytes = self._reader_took_bytes()  # (read at every wake-up: the next one's baseline)
        if sender is not None and pending_send == self._sends and not took_bytes:
            self._stalled = True
            sender.cancel()
            return
        mark = self._sends if sender is not None else NO_SEND
        self._watchdog = loop.call_later(self.stall_timeout, self._watch, loop, mark)

    def _reader_took_bytes(self) -> bool:
        """Whether the reader took at least ``MIN_PROGRESS_BYTES`` since the previous wake-up
        (the connection's write buffer drained by that much): a slow reader still reading a
        large event is not a stalled one. Without a transport (in-process), no."""
        if self._transport is None:
            return False
        previous = self._buffered
        self._buffered = buffered = self._transport.get_write_buffer_size()
        return previous is not None and previous - buffered >= MIN_PROGRESS_BYTES


CUT_OFF: ContextVar[bool] = ContextVar("slotserve_cut_off", default=False)
"""True in a request's task once its stream was cut off on purpose."""


class HideCutOffResponses(logging.Filter):
    """For ``uvicorn.error``: drop uvicorn's "ASGI callable returned without completing
    response" error for a stream we cut off on purpose (already logged at INFO, and uvicorn
    then closes the connection, which is what we want). Any other such error still shows."""

    MESSAGE = "ASGI callable returned without completing response."

    def filter(self, record: logging.LogRecord) -> bool:
        return not (CUT_OFF.get() and record.getMessage() == self.MESSAGE)


def hide_cut_off_responses() -> None:
    """Install ``HideCutOffResponses`` on uvicorn's logger, once."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, HideCutOffResponses) for f in logger.filters):
        logger.addFilter(HideCutOffResponses())


def _is_cancellation(err: BaseException) -> bool:
    if isinstance(err, BaseExceptionGroup):
        return all(_is_cancellation(e) for e in err.exceptions)
    return isinstance(err, asyncio.CancelledError)


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
