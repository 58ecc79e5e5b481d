"""Shared fixtures: an in-process app client (httpx ASGI transport, lifespan run by hand)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.api.app import create_app
from app.config import Settings
from app.models.protocol import Model
from app.serving import Serving

ClientFactory = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@asynccontextmanager
async def app_client(
    model: Model | None = None, **settings: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A client bound to a fresh app whose engine runs for the duration of the block.
    ``client.serving`` is the app's ``Serving``."""
    app: FastAPI = create_app(Settings(**settings), model)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.serving = app.state.serving  # type: ignore[attr-defined]
            client.asgi_app = app  # type: ignore[attr-defined]
            yield client


@pytest.fixture
def make_client() -> ClientFactory:
    return app_client


def serving_of(client: httpx.AsyncClient) -> Serving:
    serving: Serving = client.serving  # type: ignore[attr-defined]
    return serving
