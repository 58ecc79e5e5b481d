"""The Responses API's store: finished (and background) responses kept in memory, bounded in
count (``--responses-store-size``), bytes (``--responses-store-bytes``) and age
(``--responses-store-seconds``), so that ``GET /v1/responses/{id}``, ``previous_response_id``
and ``POST /v1/responses/{id}/cancel`` work. A restart loses them (one process, no disk).

Contract: ``put`` keeps an entry (a no-op with size 0) and records its size (``entry_bytes``:
its response object as JSON plus its conversation's text); past either bound the oldest
finished entries go first, so a finished entry larger than the byte bound is not kept at all
(a running response is never evicted: its cancel must find it; the API refuses a background
response past ``size`` running ones); ``get`` returns None for an unknown or expired entry
(expired: finished longer ago than the age bound) and, with an ``owner`` given, for an entry of
another owner (an API key's name: another key's response answers as if it did not exist).
Single-threaded: the event loop owns it.
"""

from __future__ import annotations

import asyncio
import json
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
    owner: str | None = None  # the API key's name that created it (None: no keys)
    cancelled: bool = False  # a cancel was asked for
    finished_at: float | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    size: int = 0  # bytes counted against the store's bound (set by ``put``)

    @property
    def status(self) -> str:
        return str(self.response["status"])

    @property
    def running(self) -> bool:
        return self.status in RUNNING


def entry_bytes(entry: Stored) -> int:
    """What ``entry`` counts against the byte bound: its response object as compact JSON, its
    conversation's text and its call ids (a lower bound of its memory, proportional to it)."""
    size = len(json.dumps(entry.response, separators=(",", ":")))
    size += sum(len(message.model_dump_json(exclude_none=True)) for message in entry.messages)
    return size + sum(len(call) for call in entry.calls)


class ResponseStore:
    """Responses by id, bounded in count, bytes and age (see the module's contract)."""

    def __init__(
        self, size: int, max_age: float, max_bytes: int = 1 << 62,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.size, self.max_age, self.max_bytes, self.clock = size, max_age, max_bytes, clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0  # the entries' sizes summed

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
        self._drop(entry.id)
        entry.size = entry_bytes(entry)
        self._entries[entry.id] = entry
        self.bytes += entry.size
        self._evict()

    def finished(self, entry: Stored) -> None:
        """Mark ``entry`` finished now (its age starts)."""
        entry.finished_at = self.clock()

    def get(self, response_id: str, owner: str | None = None) -> Stored | None:
        """The entry ``response_id``, or None: unknown, expired, or (``owner`` given) another
        owner's."""
        entry = self._entries.get(response_id)
        if entry is not None and self._expired(entry):
            self._drop(response_id)
            return None
        if entry is None or (owner is not None and entry.owner != owner):
            return None
        return entry

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size

    def _expired(self, entry: Stored) -> bool:
        return entry.finished_at is not None and self.clock() - entry.finished_at > self.max_age

    def _evict(self) -> None:
        for key in [k for k, e in self._entries.items() if self._expired(e)]:
            self._drop(key)
        finished = [k for k, e in self._entries.items() if e.finished_at is not None]
        for key in finished:  # oldest first; running entries stay
            if len(self._entries) <= self.size and self.bytes <= self.max_bytes:
                return
            self._drop(key)
