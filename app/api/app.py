"""The FastAPI application factory. One app owns one ``Serving`` (one engine): run it with one
uvicorn worker per process and scale out with replicas."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from sse_starlette.sse import AppStatus

from app.api import (
    admin,
    dashboard,
    kv_transfer,
    load,
    lora,
    native,
    openai_compat,
    render,
    sleep,
    tokenize,
)
from app.api.adapters import anthropic, responses
from app.api.adapters.anthropic_errors import AnthropicErrors
from app.api.adapters.responses_store import ResponseStore
from app.api.auth import ApiKeyAuth
from app.api.errors import install_error_handlers
from app.api.faults import FaultInjector
from app.api.limits import BodySizeLimit
from app.api.streaming import ClientGone, hide_cut_off_responses
from app.config import Settings
from app.models.protocol import Model
from app.serving import Serving
from app.version import version


def create_app(settings: Settings | None = None, model: Model | None = None) -> FastAPI:
    """Build the app; the engine starts with the lifespan and stops (draining) with it."""
    settings = settings or Settings()
    serving = Serving(settings, model)
    # Streams are ended by our own drain (a final ``done`` event), not cut by sse-starlette.
    AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hide_cut_off_responses()  # after uvicorn has configured its logging
        await serving.start()
        try:
            yield
        finally:
            await serving.stop(grace=0.0)

    app = FastAPI(
        title="slotserve",
        version=version(),
        summary="Continuous-batching LLM inference server",
        lifespan=lifespan,
    )
    app.state.serving = serving
    app.state.faults = FaultInjector(settings, serving.metrics)
    app.state.responses = ResponseStore(
        settings.responses_store_size, settings.responses_store_seconds,
        int(settings.responses_store_bytes),
    )  # fmt: skip
    install_error_handlers(app)
    app.add_exception_handler(ClientGone, _client_gone)
    for module in (native, openai_compat, admin, dashboard, tokenize, anthropic, responses, load,
                   render, kv_transfer):  # fmt: skip
        app.include_router(module.router)
    if settings.enable_sleep_mode:
        app.include_router(sleep.router)
    if settings.enable_lora:
        app.include_router(lora.router)
    tokenizer_limits = dict.fromkeys((*tokenize.ROUTES, *render.ROUTES), tokenize.MAX_BODY_BYTES)
    app.add_middleware(load.OrcaLoadReport)
    app.add_middleware(
        BodySizeLimit, max_bytes=settings.max_body_bytes, route_limits=tokenizer_limits
    )
    if serving.api_keys.enabled:  # outermost: before the body is read or parsed
        app.add_middleware(ApiKeyAuth, keys=serving.api_keys)
    app.add_middleware(AnthropicErrors)  # outermost: reshapes even a 401 on /v1/messages
    return app


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it: the client has left
