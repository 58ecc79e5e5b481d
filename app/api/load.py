"""The load signals routers poll, in the shapes they read.

- ``GET /get_load``: ``{"load": N, "num_requests_running": R, "num_requests_waiting": W}``.
  The vLLM router (PyPI ``vllm-router``, ``--policy power_of_two``) polls it on every worker and
  reads the integer ``load`` alone (``src/routers/http/router.rs``, ``get_worker_load``), adding
  its own count of the requests it has in flight to that worker. ``load`` is the requests the
  engine holds, running plus waiting, summed over data-parallel ranks; the two other fields
  are the same numbers apart, for people.
- vLLM's ORCA load report (``vllm/entrypoints/openai/orca_metrics.py``): a request to
  ``/v1/completions`` or ``/v1/chat/completions`` carrying ``endpoint-load-metrics-format:
  TEXT`` (or ``JSON``, any case) gets, on a successful non-streamed answer, the header
  ``endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.25,
  named_metrics.num_requests_waiting=0.0`` (or ``JSON {"named_metrics": {...}}``), read when
  the answer is sent. As in vLLM, streamed answers, errors and other formats get no header.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.deps import ServingDep
from app.serving import Serving

router = APIRouter(tags=["routers"])
FORMAT_HEADER = b"endpoint-load-metrics-format"
REPORT_HEADER = b"endpoint-load-metrics"
REPORTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass(frozen=True)
class Load:
    """The engine's load now: requests in a slot, requests waiting for one (both summed over
    data-parallel ranks) and the share of KV-cache blocks in use (the ranks' mean)."""

    running: int
    waiting: int
    kv_cache_usage: float


def current_load(serving: Serving) -> Load:
    """What the engines hold now (all zero while a real model is still loading)."""
    cores = [engine.core for engine in serving.engines]
    if not cores:
        return Load(0, 0, 0.0)
    usage = [core.kv_cache_usage() for core in cores]
    return Load(
        running=sum(core.num_running for core in cores),
        waiting=sum(core.num_waiting for core in cores),
        kv_cache_usage=sum(usage) / len(usage),
    )


@router.get("/get_load")
async def get_load(serving: ServingDep) -> dict[str, int]:
    """The requests this server holds, as the vLLM router's ``power_of_two`` policy reads it."""
    load = current_load(serving)
    return {
        "load": load.running + load.waiting,
        "num_requests_running": load.running,
        "num_requests_waiting": load.waiting,
    }


def orca_header(metrics_format: str, load: Load) -> str | None:
    """The ``endpoint-load-metrics`` value for ``metrics_format`` (TEXT or JSON, any case), as
    vLLM writes it; None for another format (vLLM then sends no header)."""
    named = {
        "kv_cache_usage_perc": float(load.kv_cache_usage),
        "num_requests_waiting": float(load.waiting),
    }
    kind = metrics_format.strip().lower()
    if kind == "text":
        return "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())
    if kind == "json":
        return "JSON " + json.dumps({"named_metrics": named})
    return None


class OrcaLoadReport:
    """ASGI middleware adding vLLM's ORCA header to the non-streamed answers of the OpenAI
    generation routes when the request asks for it (the routes themselves stay unaware)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in REPORTED_PATHS:
            await self.app(scope, receive, send)
            return
        asked = next((v for k, v in scope["headers"] if k == FORMAT_HEADER), None)
        if asked is None:
            await self.app(scope, receive, send)
            return
        metrics_format = asked.decode("latin-1")
        serving: Serving = scope["app"].state.serving

        async def send_with_report(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 200:
                headers = list(message.get("headers", []))
                content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                report = orca_header(metrics_format, current_load(serving))
                if content_type.startswith(b"application/json") and report is not None:
                    headers.append((REPORT_HEADER, report.encode("latin-1")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_report)
