"""Operational routes: ``/health``, ``/version``, ``/metrics`` (Prometheus) and ``/slots``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import KeyNameDep, ServingDep
from app.api.errors import Unavailable, documented, not_serving, response_for
from app.engine.engine import Engine
from app.version import version

router = APIRouter(tags=["operations"])


@router.get(
    "/health",
    responses=documented((Unavailable, "loading the model, draining, or the engine is dead")),
)
async def health(serving: ServingDep) -> Response:
    """200 with an empty body while serving (as vLLM answers it); 503 with ``{"status": why}``
    while a real model loads (or failed to load), while draining for shutdown, once the engine
    task has died, or while every slot is out of service (the model cannot reset any)."""
    state = serving.state
    if state == "ok":
        return Response()
    err = not_serving(state)
    return response_for(err, {"status": state})


@router.get("/version")
async def server_version() -> dict[str, str]:
    """``{"version": ...}``, as vLLM answers it (slotserve's version here)."""
    return {"version": version()}


@router.get("/metrics")
async def metrics(serving: ServingDep) -> Response:
    """Prometheus text format, vLLM metric names (``vllm:*``) plus ``slotserve:*``."""
    return Response(generate_latest(serving.ranks.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/slots")
async def slots(serving: ServingDep, key_name: KeyNameDep) -> dict[str, Any]:
    """The slot table now: per slot its request, tokens generated, max_tokens and age. With API
    keys, a slot running another key's request shows without its request id and user."""

    def table(rank: int, engine: Engine) -> dict[str, Any]:
        return {"num_slots": engine.config.num_slots, "running": engine.core.num_running,
                "waiting": engine.core.num_waiting,
                "slots": serving.ranks.slots(rank, key_name)}  # fmt: skip

    out = table(0, serving.engine)  # (serving.engine: 503 while a real model loads)
    if len(serving.engines) > 1:  # --data-parallel-size: the above is rank 0's; every rank's
        out["ranks"] = [{"rank": rank} | table(rank, e) for rank, e in enumerate(serving.engines)]
    return out
