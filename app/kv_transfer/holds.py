"""The producer's held blocks: a finished prefill's KV, kept for the decoder that will pull it.

Held blocks count as used in the KV books until ``take`` (the pull) or ``expire`` (after
``hold_seconds``) lets them go; at most ``max_held`` requests, and half the cache's blocks, are
held at once (past that the oldest go first, as if they expired: requests nobody pulls cannot
starve the cache). The block ids are this server's names for the blocks, handed
out in turn; they only have to match between the answer and the pull.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_HOLD_SECONDS = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default
DEFAULT_MAX_HELD = 4096


@dataclass(frozen=True, slots=True)
class Held:
    """One finished prefill's blocks, and when they are let go unpulled."""

    block_ids: tuple[int, ...]
    num_tokens: int
    expires: float


class Holds:
    """Held blocks by request id, in the order they were held."""

    def __init__(
        self, total_blocks: int, hold_seconds: float = DEFAULT_HOLD_SECONDS,
        max_held: int = DEFAULT_MAX_HELD,
    ) -> None:  # fmt: skip
        self._total = max(1, total_blocks)
        self._hold_seconds = hold_seconds
        self._max_held = max_held
        # the holds by request id, oldest first; read-only outside, where an empty one tells
        # that nothing is held without a call
        self.by_id: OrderedDict[str, Held] = OrderedDict()
        self._next_id = 0
        self.blocks = 0  # blocks held now
        self.expired = 0  # requests let go unpulled, ever

    def __len__(self) -> int:
        return len(self.by_id)

    def hold(self, request_id: str, num_blocks: int, num_tokens: int, now: float) -> Held:
        """Keep ``num_blocks`` blocks for ``request_id``; returns what its answer names."""
        self.take(request_id)  # a reused id replaces its older hold
        while self.by_id and (
            len(self.by_id) >= self._max_held or self.blocks + num_blocks > self._total // 2
        ):
            self._drop(next(iter(self.by_id)))
        first, self._next_id = self._next_id, (self._next_id + num_blocks) % self._total
        ids = tuple((first + i) % self._total for i in range(num_blocks))
        held = Held(ids, num_tokens, now + self._hold_seconds)
        self.by_id[request_id] = held
        self.blocks += num_blocks
        return held

    def take(self, request_id: str) -> Held | None:
        """Let ``request_id``'s blocks go because they were pulled; ``None`` if not held."""
        held = self.by_id.pop(request_id, None)
        if held is not None:
            self.blocks -= len(held.block_ids)
        return held

    @property
    def next_expiry(self) -> float | None:
        """When the oldest hold is let go unpulled (None: nothing is held)."""
        return next(iter(self.by_id.values())).expires if self.by_id else None

    def expire(self, now: float) -> int:
        """Let go every hold past its time; returns how many."""
        gone = 0
        while self.by_id:
            request_id, held = next(iter(self.by_id.items()))
            if held.expires > now:
                break
            self._drop(request_id)
            gone += 1
        return gone

    def _drop(self, request_id: str) -> None:
        self.take(request_id)
        self.expired += 1
