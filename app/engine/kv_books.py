"""The KV cache's books, kept in one place (the scheduler) for every model.

A request holds ``ceil(num_computed_tokens / block_size)`` blocks; the cache has
``capacity_tokens // block_size`` blocks. ``vllm:kv_cache_usage_perc`` is blocks in use over
blocks in all. The scheduler asks ``room_for`` before it schedules tokens, so the books never
exceed the capacity.
"""

from __future__ import annotations

from app.engine.types import Sequence


class KVBooks:
    """Blocks in use and free. Invariant: ``used == sum(seq.num_blocks)`` over running requests,
    and ``0 <= used <= total``."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity_tokens < block_size:
            raise ValueError(
                f"kv_cache_tokens ({capacity_tokens}) must hold at least one block "
                f"({block_size} tokens)"
            )
        self.block_size = block_size
        self.total = capacity_tokens // block_size
        self.used = 0

    @property
    def capacity_tokens(self) -> int:
        return self.total * self.block_size

    @property
    def free(self) -> int:
        return self.total - self.used

    @property
    def usage(self) -> float:
        return self.used / self.total

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def room_for(self, seq: Sequence, reserved: int = 0) -> int:
        """How many more tokens ``seq`` can compute with the blocks it holds plus the free
        blocks beyond ``reserved``."""
        blocks = seq.num_blocks + self.free - reserved
        return max(0, blocks * self.block_size - seq.num_computed_tokens)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` could fit the whole cache alone."""
        return self.blocks_for(num_tokens) <= self.total

    def computed(self, seq: Sequence, num_computed: int) -> None:
        """``seq`` now has ``num_computed`` tokens computed: charge the blocks that takes."""
        blocks = -(-num_computed // self.block_size)
        self.used += blocks - seq.num_blocks
        seq.num_blocks = blocks
        seq.num_computed_tokens = num_computed

    def free_all(self, seq: Sequence) -> None:
        """``seq`` left its slot: its blocks are free and nothing of it is computed."""
        self.used -= seq.num_blocks
        seq.num_blocks = 0
        seq.num_computed_tokens = 0
