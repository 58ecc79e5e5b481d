"""Anthropic's error shape on Anthropic's routes, as pure-ASGI middleware.

Every error answer of this server is built once, in OpenAI's shape (``app.api.errors``), by the
same code on every route: authentication (401), body limits (413), validation (400), engine
refusals (429, 503), failures injected on purpose. On a path under ``/v1/messages`` this
middleware rewrites such an answer (status >= 400 with a JSON ``{"error": {...}}`` body) into
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type for the
status (the message names the field, as ``param`` did), and 503 (overloaded, draining) becomes
Anthropic's 529 ``overloaded_error``. Headers such as ``Retry-After`` are kept. Streams (status
200) pass through untouched: their error event is already Anthropic's
(``anthropic.MessageEvents``). An unexpected exception (a bug),
which Starlette would answer outside every middleware in OpenAI's shape, is logged and
answered here as Anthropic's 500 ``api_error`` when no response has started.
"""

from __future__ import annotations

import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("slotserve.api")
PREFIX = "/v1/messages"
OVERLOADED = 529
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}  # any other 4xx: invalid_request_error; any other 5xx: api_error
STATUS = {503: OVERLOADED}


def anthropic_error(status: int, body: bytes) -> tuple[int, bytes]:
    """The status and body of an error answer in Anthropic's shape."""
    status = STATUS.get(status, status)
    try:
        error = json.loads(body)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param = body.decode("utf-8", "replace"), None
    if isinstance(param, str) and param not in message:  # Anthropic's shape has no param
        message = f"{param}: {message}"
    default = "api_error" if status >= 500 else "invalid_request_error"
    kind = ERROR_TYPES.get(status, default)
    shaped = {"type": "error", "error": {"type": kind, "message": message}}
    return status, json.dumps(shaped).encode()


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
    status, body = anthropic_error(500, b'{"error": {"message": "internal server error"}}')
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _is_json_error(start: Message) -> bool:
    if start["status"] < 400:
        return False
    headers: dict[bytes, bytes] = dict(start.get("headers", []))
    return headers.get(b"content-type", b"").startswith(b"application/json")
