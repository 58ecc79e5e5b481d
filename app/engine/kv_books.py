"""The KV cache's books, defined once, in the scheduler, for every model.

A running request holds ``ceil(num_computed_tokens / block_size)`` blocks; the cache has
``capacity_tokens // block_size`` blocks. ``vllm:kv_cache_usage_perc`` is blocks in use over
blocks in all. The books are derived from the running requests whenever they are read, so they
cannot drift from them; while planning a step the scheduler counts down the free blocks it hands
out, so a step never needs more than the cache holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.engine.types import Sequence


class KVBooks:
    """The cache's size in blocks and the arithmetic on it."""

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

    @property
    def capacity_tokens(self) -> int:
        return self.total * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def used(self, running: Iterable[Sequence]) -> int:
        """Blocks held by ``running``."""
        size = self.block_size
        return sum(-(-seq.num_computed_tokens // size) for seq in running)

    def usage(self, running: Iterable[Sequence]) -> float:
        return self.used(running) / self.total

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` could fit the whole cache alone."""
        return self.blocks_for(num_tokens) <= self.total

    def room(self, computed: int, free_blocks: int) -> int:
        """Tokens a request with ``computed`` tokens can add with its own blocks' spare room
        and ``free_blocks`` more."""
        return max(0, (self.blocks_for(computed) + free_blocks) * self.block_size - computed)
