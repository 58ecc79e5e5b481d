"""Anthropic's error shape on Anthropic's routes, as pure-ASGI middleware.

Every error answer of this server is built once, in OpenAI's shape (``app.api.errors``), by the
same code on every route: authentication (401), body limits (413), validation (400), engine
refusals (429, 503), failures injected on purpose. On a path under ``/v1/messages`` this
middleware rewrites such an answer (status >= 400 with a JSON ``{"error": {...}}`` body) into
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type for the
status (the message names the field, as ``param`` did), and 503 (overloaded, draining) becomes
Anthropic's 529 ``overloaded_error``. Headers such as ``Retry-After`` are kept. Streams (status
200) pass through untouched: their error event is already Anthropic's
(``anthropic.MessageEvents``). The mapping is ``app.api.errors.anthropic_error``'s. An
unexpected exception (a bug), which Starlette would answer outside every middleware in
OpenAI's shape, is logged and answered here as Anthropic's 500 ``api_error`` when no response
has started.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import ServerFault, anthropic_error, is_error, log

PREFIX = "/v1/messages"


class AnthropicErrors:
    """Rewrites error answers under ``PREFIX`` into Anthropic's shape (see the module)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        started = False
        chunks: list[bytes] = []

        async def reshaping_send(message: Message) -> None:
            nonlocal start, started
            if message["type"] == "http.response.start":
                started = True
                if _is_json_error(message):
                    start = message
                    return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, body = anthropic_error(start["status"], b"".join(chunks))
            headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
            headers.append((b"content-length", b"%d" % len(body)))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        try:
            await self.app(scope, receive, reshaping_send)
        except Exception:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope["path"])
            await _send_internal_error(send)


async def _send_internal_error(send: Send) -> None:
    status, body = anthropic_error(ServerFault.status, ServerFault("internal server error").json())
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _is_json_error(start: Message) -> bool:
    if not is_error(start["status"]):
        return False
    headers: dict[bytes, bytes] = dict(start.get("headers", []))
    return headers.get(b"content-type", b"").startswith(b"application/json")
