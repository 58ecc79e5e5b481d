"""The two model interfaces the engine drives.

``StatelessModel`` is the seed's: every call receives each sequence's full token prefix.
``CachedModel`` keeps a key/value cache per batch slot: the engine tells it when a slot is given
to a request (with the prompt to prefill) and when the slot is released; a released slot's cache
must be reset before the slot is assigned again.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class StatelessModel(Protocol):
    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        """``batch[i]`` is one sequence's whole prefix (prompt + generated so far). Returns one
        next token per entry, in the same order. Must not modify the lists it is given."""
        ...


@runtime_checkable
class CachedModel(Protocol):
    def assign(self, slot: int, prompt: list[int]) -> None:
        """Slot ``slot`` now holds a new request; its cache must be empty. Prefill ``prompt``."""
        ...

    def release(self, slot: int) -> None:
        """The request in ``slot`` ended: drop its cache so the slot can be reused."""
        ...

    def decode(self, slots: list[int], last_tokens: list[int | None]) -> list[int]:
        """One decode step for the given slots. ``last_tokens[i]`` is the token generated for
        ``slots[i]`` by the previous step (None on the slot's first step after ``assign``); the
        model appends it to that slot's cache. Returns one next token per slot, in order."""
        ...


Model = StatelessModel | CachedModel
"""A model may also set ``blocking = False`` to say its calls are quick and never wait, so the
engine runs them on the event loop instead of in a worker thread. Without it, a model is
assumed to block (a real model does) and every call runs in the engine's worker thread."""
