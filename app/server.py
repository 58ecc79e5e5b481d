"""Running the app under uvicorn with a graceful drain on SIGTERM.

uvicorn alone would stop listening at once and wait for open streams without ending them. Here
the first SIGTERM/SIGINT starts a drain instead: ``/health`` and new requests answer 503, running
requests may finish within ``shutdown_grace`` seconds, the rest end with a ``done`` event whose
``finish_reason`` is ``abort``; only then is uvicorn told to exit. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from app.api.connection import ConnectionLimits, connection_bound, guarded_protocol
from app.serving import Serving

log = logging.getLogger("slotserve.server")
CLOSE_TIMEOUT = 2  # seconds uvicorn may take to close connections once the drain is done
PROBE_PATHS = ("/health", "/metrics")  # polled every few seconds: their access lines are DEBUG


class ProbesAtDebug(logging.Filter):
    """Logs uvicorn's access lines for ``PROBE_PATHS`` at DEBUG, so load balancers' health
    checks and Prometheus' scrapes do not flood an INFO log; other requests are unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) > 2 else None
        if not isinstance(path, str) or path.partition("?")[0] not in PROBE_PATHS:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, serving: Serving) -> None:
        super().__init__(config)
        self.serving = serving
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is not None or self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # second signal, or not serving yet: exit now
            if self._drain is not None:
                self.force_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain, sig, frame)

    def _start_drain(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        grace = self.serving.settings.shutdown_grace
        log.info("signal %d: draining for up to %.1f s", sig, grace)
        try:
            await self.serving.stop(grace)
        finally:
            super().handle_exit(sig, frame)


def run(app: FastAPI, host: str, port: int, log_level: str) -> None:
    """Serve ``app`` (one worker: the engine lives in this process) until drained, behind the
    connection guards of ``app.api.connection``."""
    serving: Serving = app.state.serving
    settings = serving.settings
    limits = ConnectionLimits(
        max_header_bytes=settings.max_header_bytes,
        header_timeout=settings.header_timeout,
        max_connections=connection_bound(settings.max_connections),
    )
    config = uvicorn.Config(
        app,
        http=guarded_protocol(limits),
        host=host,
        port=port,
        log_level=log_level,
        workers=1,
        lifespan="on",
        timeout_graceful_shutdown=CLOSE_TIMEOUT,
        timeout_keep_alive=5,
    )
    logging.getLogger("uvicorn.access").addFilter(ProbesAtDebug())  # after uvicorn's logging setup
    DrainingServer(config, serving).run()
