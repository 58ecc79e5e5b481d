"""Shared fixtures: an in-process app client (httpx ASGI transport, lifespan run by hand)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.api.app import create_app
from app.config import Settings
from app.models.protocol import Model
from app.serving import Serving

ClientFactory = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]
# A real model that tests do not load to test compiling runs eager (``--compile`` defaults to
# auto): tests/models/test_hf_compile.py compiles on purpose; the rest would pay a compile.
os.environ.setdefault("SLOTSERVE_COMPILE", "off")

# Modules that need torch as soon as they are imported (a real model in every test). Tests of a
# real model elsewhere carry the ``real_model`` mark. ``pytest --mock-only`` (``make test-fast``)
# leaves both out, so it runs where torch is not installed.
REAL_MODEL_MODULES = frozenset({
    "test_hf_compile.py", "test_hf_deploy.py", "test_hf_dtype.py", "test_hf_logits_processors.py",
    "test_hf_model.py", "test_hf_quantization.py", "test_hf_sampling.py", "test_hf_serving.py",
    "test_hf_smollm2.py", "test_hf_text.py", "test_lm_eval.py", "test_tools_hf.py",
})  # fmt: skip


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mock-only",
        action="store_true",
        help="only the tests that need no torch and no real model (make test-fast)",
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("mock_only") and collection_path.name in REAL_MODEL_MODULES:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("mock_only"):
        return
    real = [item for item in items if item.get_closest_marker("real_model")]
    if real:
        config.hook.pytest_deselected(items=real)
        items[:] = [item for item in items if not item.get_closest_marker("real_model")]


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
