"""Readiness: whether the server takes generation now. Not while asleep (vLLM's sleep mode:
``POST /sleep``, ``POST /wake_up``) nor within ``--startup-delay`` of the start."""

from __future__ import annotations

import logging
import time

from app.engine.engine import Engine
from app.engine.errors import EngineError

log = logging.getLogger("slotserve.serving")

SLEEP_PARTS = frozenset({"weights", "kv_cache"})  # what vLLM's /wake_up?tags= may name


class NotReadyError(EngineError):
    """The server does not take generation now: asleep (``POST /sleep``) or within
    ``--startup-delay``. ``code`` names which (``sleeping``, ``starting``)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Readiness:
    """The parts still asleep, the sleep level, and when the startup delay ends."""

    def __init__(self) -> None:
        self.asleep: frozenset[str] = frozenset()  # the parts still asleep (see ``sleep``)
        self.level = 0
        self.ready_at = 0.0  # monotonic time --startup-delay ends (set by ``start``)

    def start(self, delay: float) -> None:
        """The server starts now: it takes generation ``delay`` seconds from now."""
        self.ready_at = time.monotonic() + delay

    @property
    def state(self) -> str | None:
        """``sleeping``, ``starting`` (within the startup delay), or None (ready)."""
        if self.asleep:
            return "sleeping"
        return "starting" if time.monotonic() < self.ready_at else None

    def check(self) -> None:
        """``NotReadyError`` unless ready."""
        state = self.state
        if state == "sleeping":
            message = f"the server is asleep (level {self.level}): POST /wake_up first"
            raise NotReadyError(message, state)
        if state == "starting":
            raise NotReadyError("the server is starting (--startup-delay)", state)

    async def sleep(self, level: int, engines: list[Engine]) -> None:
        """vLLM's sleep mode: from now on generation is refused (503 ``sleeping``), requests in
        flight on ``engines`` end with ``abort``, and once they are idle their prefix caches
        are emptied (level 1 offloads the weights and discards the KV cache, level 2 discards
        both: the mocks have no weights, so both levels do the same here and only the level
        is kept)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.asleep, self.level = SLEEP_PARTS, level
        for engine in engines:
            for request_id in list(engine.core.live):
                engine.abort(request_id)
        for engine in engines:
            await engine.wait_idle()
            await engine.reset_prefix_cache()
        log.info("asleep (level %d)", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (``weights``, ``kv_cache``; None: everything) up; the server serves
        again once nothing is asleep."""
        unknown = set(tags or ()) - SLEEP_PARTS
        if unknown:
            raise ValueError(f"unknown wake-up tag {sorted(unknown)[0]!r}: weights or kv_cache")
        self.asleep = frozenset() if tags is None else self.asleep - set(tags)
        if not self.asleep:
            self.level = 0
            log.info("awake")
