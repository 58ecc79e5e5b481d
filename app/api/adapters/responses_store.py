"""The Responses API's store: finished (and background) responses kept in memory, bounded in
count (``--responses-store-size``) and age (``--responses-store-seconds``), so that
``GET /v1/responses/{id}``, ``previous_response_id`` and ``POST /v1/responses/{id}/cancel``
work. A restart loses them (one process, no disk).

Contract: ``put`` keeps an entry (a no-op with size 0); past the size bound the oldest finished
entries go first (a running response is never evicted: its cancel must find it; the API
refuses a background response past ``size`` running ones);
``get`` returns None for an unknown or expired entry (expired: finished longer ago than the age
bound). Single-threaded: the event loop owns it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.api.schemas import ChatMessage

RUNNING = ("queued", "in_progress")


@dataclass(slots=True)
class Stored:
    """One response: its object as last reported and the conversation it continues with."""

    id: str
    response: dict[str, Any]
    messages: list[ChatMessage]  # input and output, without the instructions (not carried over)
    calls: set[str]  # function call ids a later function_call_output may answer
    background: bool = False
    cancelled: bool = False  # a cancel was asked for
    finished_at: float | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def status(self) -> str:
        return str(self.response["status"])

    @property
    def running(self) -> bool:
        return self.status in RUNNING


class ResponseStore:
    """Responses by id, bounded in count and age (see the module's contract)."""

    def __init__(
        self, size: int, max_age: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.size, self.max_age, self.clock = size, max_age, clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def running_background(self) -> int:
        """Background responses still running (bounded by the API: at most ``size``)."""
        return sum(1 for e in self._entries.values() if e.background and e.running)

    def put(self, entry: Stored) -> None:
        if not self.enabled:
            return
        self._entries[entry.id] = entry
        self._entries.move_to_end(entry.id)
        self._evict()

    def finished(self, entry: Stored) -> None:
        """Mark ``entry`` finished now (its age starts)."""
        entry.finished_at = self.clock()

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None and self._expired(entry):
            del self._entries[response_id]
            return None
        return entry

    def _expired(self, entry: Stored) -> bool:
        return entry.finished_at is not None and self.clock() - entry.finished_at > self.max_age

    def _evict(self) -> None:
        for key in [k for k, e in self._entries.items() if self._expired(e)]:
            del self._entries[key]
        excess = len(self._entries) - self.size
        if excess <= 0:
            return
        finished = [k for k, e in self._entries.items() if e.finished_at is not None]
        for key in finished[:excess]:
            del self._entries[key]
