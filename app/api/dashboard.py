"""``GET /dashboard``: a live view of the slot table, fed by ``GET /dashboard/events`` (SSE).

The page (``dashboard.html``, no build step, no external assets) draws one lane per slot over
time, coloured by request (lighter while prefilling, a dark tick at a preemption), the waiting
queue, tokens/s, the mean step time and KV usage. Frames are built by one ``DashboardFeed`` per
app, at most ``FRAME_HZ`` times a second and only while someone watches, so an unwatched server
pays nothing and every watcher shares each frame. At most ``MAX_WATCHERS`` streams are open at
once (more: 503); a watcher that stops reading is dropped after ``SEND_TIMEOUT``, and every
stream ends, after a last frame, when the server starts draining (so shutdown never waits for
a dashboard). Like ``/metrics`` it is open without an API key, so a frame carries no
request id, prompt, text or key name: a request is only a colour (a hue from its id's hash).
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from functools import partial
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sse_starlette import EventSourceResponse

from app.api.deps import ServingDep
from app.api.errors import RETRY_AFTER, Unavailable, not_serving
from app.engine.snapshot import EngineSnapshot, SlotView
from app.metrics import StepTotals
from app.serving import Serving

FRAME_HZ = 4.0  # frames a second while watched
MAX_WATCHERS = 16  # open event streams; each shares the same frames
SEND_TIMEOUT = 10.0  # seconds a frame may wait for a watcher that stopped reading: then it goes
ENDED = frozenset({"draining", "engine_dead"})  # states after which no frame follows
PAGE = files("app.api").joinpath("dashboard.html").read_text(encoding="utf-8")

router = APIRouter(tags=["operations"])


def hue(request_id: str) -> int:
    """A stable colour (hue, 0-359) for a request that does not reveal its id."""
    return zlib.crc32(request_id.encode()) % 360


def slot_cell(view: SlotView | None) -> list[int] | None:
    """``[hue, decoding (0/1), generated, max_tokens, preemptions]``, None for a free slot."""
    if view is None:
        return None
    decoding = 0 if view.prefilling else 1
    return [hue(view.request_id), decoding, view.generated, view.max_tokens, view.preemptions]


def rank_frame(snapshot: EngineSnapshot) -> dict[str, Any]:
    return {
        "slots": [slot_cell(view) for view in snapshot.slots],
        "out_of_service": sorted(snapshot.out_of_service),
        "waiting": [hue(request_id) for request_id in snapshot.waiting],
        "num_waiting": snapshot.num_waiting,
        "kv_usage": round(snapshot.kv_usage, 4),
    }


class DashboardFeed:
    """Builds a frame every ``1 / FRAME_HZ`` s while at least one watcher is connected and
    hands each frame to every watcher (``frames``). Runs on the event loop; a frame costs
    O(slots) and is encoded once whoever watches."""

    def __init__(self, serving: Serving, hz: float = FRAME_HZ) -> None:
        self.serving, self.interval = serving, 1.0 / hz
        self.watchers = 0
        self._frame = b""
        self._number = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._last: tuple[float, StepTotals] | None = None  # at the previous frame, for rates
        self.ended = False  # the server stopped serving for good: streams end, none start

    def frame(self) -> dict[str, Any]:
        """The current state of every rank, plus rates since the previous frame."""
        serving, now = self.serving, time.monotonic()
        totals = [metrics.totals for metrics in serving.ranks.metrics]
        steps = sum(t.steps for t in totals)
        seconds = sum(t.step_seconds for t in totals)
        total = StepTotals(steps, seconds, sum(t.generated for t in totals))
        body: dict[str, Any] = {
            "model": serving.settings.model_name,
            "state": serving.state,
            "ranks": [rank_frame(engine.core.snapshot()) for engine in serving.engines],
            "tokens_per_s": None,
            "step_ms": None,
            "steps_per_s": None,
        }
        at, last = self._last or (now, total)
        if now > at:
            span = now - at
            body["tokens_per_s"] = round((total.generated - last.generated) / span, 1)
            body["steps_per_s"] = round((steps - last.steps) / span, 1)
            if steps > last.steps:
                body["step_ms"] = round(
                    1000 * (seconds - last.step_seconds) / (steps - last.steps), 3
                )
        self._last = (now, total)
        return body

    async def frames(self) -> AsyncGenerator[bytes, None]:
        """Each new frame as JSON, starting with the next one; stops the producer when the
        last watcher leaves. The caller checks ``watchers`` against ``MAX_WATCHERS``."""
        self.watchers += 1
        if self._task is None:
            self._task = asyncio.create_task(self._produce())
        seen = self._number
        try:
            while not self.ended:
                async with self._changed:
                    await self._changed.wait_for(partial(self._newer_than, seen))
                    seen, frame = self._number, self._frame
                if frame:
                    yield frame
        finally:
            self.watchers -= 1
            if self.watchers == 0 and self._task is not None:
                self._task.cancel()
                self._task, self._last = None, None

    def _newer_than(self, number: int) -> bool:
        return self._number != number or self.ended

    async def _produce(self) -> None:
        while not self.ended:
            body = self.frame()
            frame = json.dumps(body, separators=(",", ":")).encode()
            async with self._changed:
                self._frame, self._number = frame, self._number + 1
                self.ended = body["state"] in ENDED  # this frame says so; it is the last
                self._changed.notify_all()
            await asyncio.sleep(self.interval)


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    """The live view (one self-contained HTML page)."""
    return HTMLResponse(PAGE)


@router.get("/dashboard/events", include_in_schema=False)
async def dashboard_events(request: Request, serving: ServingDep) -> EventSourceResponse:
    """Server-sent events: one ``data:`` JSON frame at most ``FRAME_HZ`` times a second."""
    feed: DashboardFeed | None = getattr(request.app.state, "dashboard", None)
    if feed is None:  # the app's one feed, made on first use
        feed = request.app.state.dashboard = DashboardFeed(serving)
    if feed.ended or serving.state in ENDED:
        raise not_serving(serving.state)
    if feed.watchers >= MAX_WATCHERS:
        retry = {"Retry-After": RETRY_AFTER}  # 503 past the open streams' bound: one may close
        raise Unavailable(f"at most {MAX_WATCHERS} dashboards may watch at once",
                          code="too_many_watchers", headers=retry)  # fmt: skip

    async def events() -> AsyncIterator[dict[str, str]]:
        async for frame in feed.frames():
            yield {"data": frame.decode()}

    return EventSourceResponse(events(), ping=15, send_timeout=SEND_TIMEOUT)
