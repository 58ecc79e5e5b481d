"""Dependencies: the serving context and the authenticated API key's name. Both are async, so
FastAPI runs them on the event loop instead of sending each request through its thread pool."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.api.auth import STATE_KEY
from app.serving import Serving


async def get_serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


async def get_key_name(request: Request) -> str | None:
    """The name of the API key the request was authenticated with (``app.api.auth``), or None
    when the server has no keys."""
    name: str | None = getattr(request.state, STATE_KEY, None)
    return name


ServingDep = Annotated[Serving, Depends(get_serving)]
KeyNameDep = Annotated[str | None, Depends(get_key_name)]
