"""Connection-level guards, below any route: uvicorn's httptools protocol with bounds on what a
client can hold before its request even reaches the app.

- **Header block.** The request line and headers may take at most ``max_header_bytes``: past
  that the client gets 431 and the connection is closed, before more than the bound is
  buffered (uvicorn's httptools mode has no limit of its own).
- **Header deadline.** A request's headers must be complete ``header_timeout`` seconds after
  its first byte (or after the connection opened): otherwise 408 and close (slowloris).
- **Connections.** Past ``max_connections`` open connections, new requests get 503, except
  ``/health`` and ``/metrics``, which keep ``HEADROOM`` more connections. Past that, a new
  connection closes the one that has waited longest for its request headers (a slowloris, or
  an idle keep-alive), or if none is waiting, gets 503 and is closed itself. So trickling
  connections cannot lock out ``/health``, and the bound stays below the process's file limit.
- **Send buffer.** Each socket's kernel send buffer is capped at ``STREAM_BUFFER_BYTES``, so a
  client that stops reading blocks a stream's sends after about that much unread data, not
  after the megabyte or more the kernel would otherwise queue. The connection's transport is
  in the ASGI scope (``scope["extensions"][EXTENSION]["transport"]``), so a stream can abort
  it at once.
"""

from __future__ import annotations

import asyncio
import resource
import socket
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.api.errors import ERROR_CODE_HEADER, error_json, log

EXTENSION = "slotserve.connection"
HEADROOM = 32  # connections kept for /health and /metrics past max_connections
FILE_RESERVE = 128  # descriptors kept for everything else when the bound is derived
STREAM_BUFFER_BYTES = 16 * 1024  # kernel send buffer per socket (and asyncio's high-water mark)
OPEN_PATHS = frozenset({b"/health", b"/metrics"})


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_header_bytes: int
    header_timeout: float
    max_connections: int


def connection_bound(configured: int) -> int:
    """``configured``, or with 0 the soft file limit less a reserve; never past the file limit
    less ``HEADROOM`` and a few descriptors, so /health can always be accepted."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = soft - HEADROOM - 32 if soft != resource.RLIM_INFINITY else 1 << 20
    wanted = configured or soft - FILE_RESERVE
    return max(1, min(wanted, ceiling))


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` that enforces ``limits``."""
    return type("SlotserveHttpProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})


def _reply(status: int, message: str, code: str) -> bytes:
    body, reason = error_json(status, message), HTTPStatus(status).phrase.encode()
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (
        status, reason, len(body))  # fmt: skip
    head += b"%s: %s\r\n" % (ERROR_CODE_HEADER.lower().encode(), code.encode())
    extra = b"retry-after: 1\r\n" if status == 503 else b""
    return head + extra + b"connection: close\r\n\r\n" + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the guards in the module docstring."""

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_headers = True
        self._waiting_since = self.loop.time()
        self._header_bytes = 0
        self._header_blocks = 0  # header blocks parsed on this connection
        self._deadline: asyncio.TimerHandle | None = None
        self._app = self.app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections + HEADROOM:
            slowest = self._slowest_other()
            if slowest is None:
                self._refuse(503, "too many open connections", "too_many_connections")
                return
            slowest._refuse(408, "closed for a new connection: request headers were still "
                            "incomplete", "header_timeout")  # fmt: skip
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER_BYTES)
        transport.set_write_buffer_limits(high=STREAM_BUFFER_BYTES)
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if not self._awaiting_headers:
            super().data_received(data)
            return
        if self._deadline is None:
            self._arm_deadline()
        room = self.limits.max_header_bytes - self._header_bytes
        self._header_bytes += len(data)
        if len(data) <= room:
            super().data_received(data)
            return
        ended = self._header_blocks
        super().data_received(data[:room])  # the part within the bound may end the headers
        if self._header_blocks == ended:  # no header block ended within the bound (a
            # pipelined request that did end one may leave the next one awaiting its headers)
            self._refuse(431, f"request line and headers exceed {self.limits.max_header_bytes} "
                         "bytes", "headers_too_large")  # fmt: skip
            return
        super().data_received(data[room:])

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # the transport, not this protocol: no reference cycle through the scope (asyncio
        # drops a transport's references when it closes)
        self.scope["extensions"] = {EXTENSION: {"transport": self.transport}}

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._header_blocks += 1
        self._disarm_deadline()
        over = len(self.connections) > self.limits.max_connections
        path = httptools.parse_url(self.url).path if over else b""
        self.app = _connection_limit_reached if over and path not in OPEN_PATHS else self._app
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_headers = True
        self._waiting_since = self.loop.time()
        self._header_bytes = 0

    def _slowest_other(self) -> GuardedHttpToolsProtocol | None:
        """The open connection, other than this one, waiting longest for request headers with
        no response in progress (a stream being sent is never chosen)."""
        waiting = [
            c
            for c in self.connections
            if isinstance(c, GuardedHttpToolsProtocol) and c is not self and c._idle()
        ]
        return min(waiting, key=lambda c: c._waiting_since, default=None)

    def _idle(self) -> bool:
        responding = self.cycle is not None and not self.cycle.response_complete
        return self._awaiting_headers and not responding and not self.transport.is_closing()

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._disarm_deadline()
        if self.transport.is_closing():
            return  # already answered (e.g. uvicorn's own 400 for a malformed request)
        log.info("refused a connection: %s (%d)", message, status)
        self.transport.write(_reply(status, message, code))
        self.transport.close()

    def _arm_deadline(self) -> None:
        self._disarm_deadline()
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self._awaiting_headers and not self.transport.is_closing():
            self._refuse(408, f"request headers not complete within "
                         f"{self.limits.header_timeout} s", "header_timeout")  # fmt: skip


async def _connection_limit_reached(scope: Any, receive: Any, send: Any) -> None:
    """The app for a request over the connection bound: 503, and the connection is closed."""
    body = error_json(503, "too many open connections, retry later")
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
               (b"retry-after", b"1"), (b"connection", b"close"),
               (ERROR_CODE_HEADER.lower().encode(), b"too_many_connections")]  # fmt: skip
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
