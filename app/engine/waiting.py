"""The queue of requests waiting for a slot: first come, first served, O(1) removal by id. A
preempted request goes back to the front, so it resumes before newer arrivals."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from app.engine.types import Sequence


class WaitingQueue:
    """Sequences in arrival order; ``remove`` (an abort) is O(1) wherever the sequence stands.
    ``by_id``, read-only outside: its truth value says if a request waits, with no call."""

    def __init__(self) -> None:
        self.by_id: OrderedDict[str, Sequence] = OrderedDict()

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.by_id

    def __iter__(self) -> Iterator[Sequence]:
        """The sequences in queue order (the queue must not change meanwhile)."""
        return iter(self.by_id.values())

    def get(self, request_id: str) -> Sequence | None:
        """The queued sequence with this id, if any."""
        return self.by_id.get(request_id)

    def push(self, seq: Sequence) -> None:
        self.by_id[seq.request_id] = seq

    def push_front(self, seq: Sequence) -> None:
        self.by_id[seq.request_id] = seq
        self.by_id.move_to_end(seq.request_id, last=False)

    def peek(self) -> Sequence:
        """The oldest sequence, left in place."""
        return next(iter(self.by_id.values()))

    def pop(self) -> Sequence:
        """Remove and return the oldest sequence."""
        return self.by_id.popitem(last=False)[1]

    def remove(self, request_id: str) -> Sequence | None:
        return self.by_id.pop(request_id, None)

    def drain(self) -> list[Sequence]:
        """Remove and return every sequence, oldest first."""
        seqs = list(self.by_id.values())
        self.by_id.clear()
        return seqs
