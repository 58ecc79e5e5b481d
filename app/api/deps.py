"""Dependencies: the serving context and the API-key check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from app.api.errors import invalid_api_key
from app.serving import Serving


def get_serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


ServingDep = Annotated[Serving, Depends(get_serving)]


def require_api_key(request: Request, serving: ServingDep) -> None:
    """With ``--api-key`` set, demand ``Authorization: Bearer <key>`` (constant-time compare)."""
    secret = serving.settings.api_key
    if secret is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    expected = secret.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
        raise invalid_api_key()


Authorized = [Depends(require_api_key)]
