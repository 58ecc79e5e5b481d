"""API-key authentication as pure-ASGI middleware, so it runs before anything reads the body:
a client without a valid key gets 401 even when its body would not parse, and the generated
docs (``/docs``, ``/redoc``, ``/openapi.json``) are behind the key too. Only ``/health``,
``/metrics``, ``/get_load`` and the dashboard stay open (probes, scrapers, the vLLM router's
load poll and a browser's EventSource carry no key; ``/get_load`` tells no more than
``/metrics``; the dashboard shows no ids, text or key names).

The matched key's name is stored in the ASGI scope's state (``request.state.api_key_name``);
it is None when no keys are configured. Names may be logged and used as metric labels; keys
never are.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import invalid_api_key, response_for
from app.keys import ApiKeys

OPEN_PATHS = frozenset({"/health", "/metrics", "/get_load", "/dashboard", "/dashboard/events"})
STATE_KEY = "api_key_name"


class ApiKeyAuth:
    """Answers 401 unless ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``)
    names one of ``keys``."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        name = self.keys.match(request_key(scope))
        if name is None:  # the same answer an injected invalid_api_key gives (app/api/faults.py)
            await response_for(invalid_api_key())(scope, receive, send)
            return
        scope.setdefault("state", {})[STATE_KEY] = name
        await self.app(scope, receive, send)


def request_key(scope: Scope) -> bytes:
    """The key a request presents: the token of its first ``Authorization`` header when that is
    ``Bearer`` (scheme case-insensitive; OpenAI's clients), else ``x-api-key`` (Anthropic's),
    else b"". Both are checked against the same named keys."""
    headers = scope["headers"]
    authorization = next((value for name, value in headers if name == b"authorization"), b"")
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return bytes(token.strip())
    return next((bytes(value.strip()) for name, value in headers if name == b"x-api-key"), b"")
