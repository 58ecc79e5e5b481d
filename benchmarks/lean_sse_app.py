"""An experiment for ``stream_memory.py``: the baseline's bare stack (FastAPI + uvicorn, a ticker
that hands every open stream one token per 20 ms step) with sse-starlette's response replaced by a
hand-written one: one task per response pumps events, one more watches for the disconnect. No
ping, no send timeout, no shutdown handling. It shows what the per-response task group costs, not
a design slotserve uses. Run: uvicorn lean_sse_app:app (from benchmarks/)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

STEP = 0.02
EVENT = b'event: token\ndata: {"tokens":[1]}\n\n'


class Ticks:
    """Tokens handed to one stream; ``left < 0`` once its client has gone."""

    __slots__ = ("event", "left")

    def __init__(self, tokens: int) -> None:
        self.left = tokens
        self.event = asyncio.Event()


open_streams: set[Ticks] = set()


async def ticker() -> None:
    while True:
        for ticks in open_streams:
            ticks.event.set()
        await asyncio.sleep(STEP)


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    task = asyncio.create_task(ticker())
    yield
    task.cancel()


app = FastAPI(lifespan=lifespan)


class LeanEventStream(Response):
    def __init__(self, ticks: Ticks) -> None:  # no Response.__init__: it sets Content-Length
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
        ]
        self.ticks = ticks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ticks = self.ticks
        watcher = asyncio.create_task(self._watch(receive))
        open_streams.add(ticks)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            while ticks.left > 0:
                await ticks.event.wait()
                ticks.event.clear()
                ticks.left -= 1
                await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            open_streams.discard(ticks)

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.ticks.left = -1
        self.ticks.event.set()


@app.post("/generate")
async def generate(request: Request) -> Response:
    body = await request.json()
    return LeanEventStream(Ticks(int(body["max_tokens"])))
