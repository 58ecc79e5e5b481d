"""The KV cache's books, defined once, in the scheduler, for every model.

A running request holds ``ceil(num_computed_tokens / block_size)`` blocks; the cache has
``capacity_tokens // block_size`` blocks. With a prefix cache, the cached blocks running requests
share count once each (``PrefixCache.num_referenced``), and cached blocks nobody references
count as free: they are evicted when needed. ``vllm:kv_cache_usage_perc`` is blocks in use over
blocks in all. The books are derived from the running requests whenever they are read, so they
cannot drift from them; while planning a step the scheduler counts down the free blocks it hands
out, so a step never needs more than the cache holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.engine.prefix_cache import PrefixCache
from app.engine.types import Sequence
from app.kv_transfer.holds import Holds


class KVBooks:
    """The cache's size in blocks and the arithmetic on it."""

    def __init__(
        self, capacity_tokens: int, block_size: int, prefix_cache: PrefixCache | None = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity_tokens < block_size:
            raise ValueError(
                f"kv_cache_tokens ({capacity_tokens}) must hold at least one block "
                f"({block_size} tokens)"
            )
        self.block_size = block_size
        self.total = capacity_tokens // block_size
        self.prefix_cache = prefix_cache
        # blocks a producer keeps for remote decoders (app/kv_transfer): used until pulled
        self.holds: Holds | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.total * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def used(self, running: Iterable[Sequence]) -> int:
        """Blocks held by ``running``: their own, plus the cached blocks they reference, plus
        the finished prefills' blocks held for a remote decoder (``holds``)."""
        size, cache = self.block_size, self.prefix_cache
        held = self.holds.blocks if self.holds is not None else 0
        if cache is None:
            return held + sum(-(-seq.num_computed_tokens // size) for seq in running)
        own = sum(
            -(-seq.num_computed_tokens // size) - (len(seq.prefix.blocks) if seq.prefix else 0)
            for seq in running
        )
        return held + own + cache.num_referenced

    def usage(self, running: Iterable[Sequence]) -> float:
        return self.used(running) / self.total

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` could fit the whole cache alone."""
        return self.blocks_for(num_tokens) <= self.total

    def room(self, computed: int, free_blocks: int) -> int:
        """Tokens a request with ``computed`` tokens can add with its own blocks' spare room
        and ``free_blocks`` more."""
        return max(0, (self.blocks_for(computed) + free_blocks) * self.block_size - computed)
