"""Pure-ASGI middleware (never ``BaseHTTPMiddleware``, which breaks disconnect detection)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import TooLarge, response_for


class BodySizeLimit:
    """Answers 413 when a request body exceeds ``max_bytes`` (or, on a path ``route_limits``
    names, the lower of that and its own limit): at once from ``Content-Length``; a body
    without one (chunked) is read up to the limit first, then replayed to the app."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, route_limits: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.route_limits = {path: min(limit, max_bytes)
                             for path, limit in (route_limits or {}).items()}  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.route_limits.get(scope["path"], self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > limit:
                await self._reject(scope, receive, send, limit)
                return
            await self.app(scope, receive, send)
            return
        buffered = await self._read_limited(receive, limit)
        if buffered is None:
            await self._reject(scope, receive, send, limit)
            return

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _read_limited(self, receive: Receive, limit: int) -> list[Message] | None:
        """The body's messages, or None once they pass ``limit`` bytes."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > limit:
                return None
            if not message.get("more_body", False):
                return messages

    async def _reject(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        error = TooLarge(f"request body exceeds {limit} bytes", code="request_too_large")
        await response_for(error)(scope, receive, send)
