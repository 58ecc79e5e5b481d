"""The fixed table of batch slots: which sequence holds which slot, and which slots are free."""

from __future__ import annotations

import heapq
from collections.abc import Set

from app.engine.types import Sequence


class SlotTable:
    """``capacity`` slots, each empty or held by one sequence.

    Free slots are handed out lowest index first, so a batch keeps a stable, compact order.
    A slot whose cache the model failed to reset is out of service (never handed out) until a
    retried reset succeeds. Invariant: ``len(free) + occupied + idle out-of-service slots ==
    capacity`` and ``seq.slot == i`` for a sequence in slot i.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"num_slots must be >= 1, got {capacity}")
        self.capacity = capacity
        self._held: list[Sequence | None] = [None] * capacity
        self.free: list[int] = list(range(capacity))  # a heap, lowest first; read-only outside
        self._occupied = 0
        self._running: list[Sequence] | None = []  # running(), rebuilt after any change
        # slots whose cache could not be reset (read-only outside; replaced whole on a change)
        self.out_of_service: frozenset[int] = frozenset()

    @property
    def occupied(self) -> int:
        return self._occupied

    @property
    def num_free(self) -> int:
        return len(self.free)

    def set_out_of_service(self, slots: Set[int]) -> None:
        """Take ``slots`` out of service and bring back every other slot that was out."""
        if not slots and not self.out_of_service:
            return  # the usual case: nothing to do
        for slot in self.out_of_service - slots:
            if self._held[slot] is None:
                heapq.heappush(self.free, slot)
        for slot in slots - self.out_of_service:
            if slot in self.free:
                self.free.remove(slot)
                heapq.heapify(self.free)
        self.out_of_service = frozenset(slots)

    def allocate(self, seq: Sequence) -> int:
        """Put ``seq`` in the lowest free slot and return its index. Raises if none is free."""
        if not self.free:
            raise RuntimeError("no free slot")
        slot = heapq.heappop(self.free)
        self._held[slot] = seq
        seq.slot = slot
        self._occupied += 1
        self._running = None
        return slot

    def release(self, seq: Sequence) -> int:
        """Free the slot ``seq`` holds and return its index."""
        slot = seq.slot
        if slot is None or self._held[slot] is not seq:
            raise RuntimeError(f"request {seq.request_id!r} holds no slot")
        self._held[slot] = None
        seq.slot = None
        self._occupied -= 1
        self._running = None
        if slot not in self.out_of_service:
            heapq.heappush(self.free, slot)
        return slot

    def get(self, slot: int) -> Sequence | None:
        return self._held[slot]

    def running(self) -> list[Sequence]:
        """The held sequences in slot order. While the table does not change, every call returns
        the same list, so it must not be modified; a change makes a new list, leaving the old
        one as it was (a plan's batch stays valid while an abort frees a slot)."""
        if self._running is None:
            self._running = [seq for seq in self._held if seq is not None]
        return self._running
