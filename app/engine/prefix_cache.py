"""The prefix cache: KV blocks of prompt prefixes, kept after their request has left, so a later
request with the same prefix does not prefill it again (vLLM's automatic prefix caching).

Only full prompt blocks are cached. Block ``i`` of a prompt is keyed by a hash along the chain:
``hash((key of block i-1, tokens of block i))``, so a block's key stands for the whole prefix up
to its end. A lookup walks a prompt's keys from the first and stops at the first block not
cached; each entry found is checked against the parent it hangs off and its own tokens, so a
hash collision is a miss, never a wrong prefix.

An entry is *referenced* by every running request whose KV it is part of, and *free* (evictable)
when none is: free entries count as free KV blocks, and are evicted least recently used first
when the blocks are needed (``evict_to``). A request's blocks are freed last block first, so a
chain's tail goes before its head. The scheduler's books (``KVBooks.used``) count a referenced
entry once however many requests share it.

With ``record_events`` set, the cache logs what a KV-event subscriber needs to mirror it, in
order: the blocks each publish stored, the blocks each eviction removed, and a clear
(``CacheEvent``). ``take_events`` hands the log over (once per engine step); without a
subscriber nothing is logged, so the cache pays nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol


@dataclass(eq=False, slots=True)
class CachedBlock:
    """One cached block: its chain key, the block it follows, its tokens, its references."""

    key: int
    parent: CachedBlock | None
    tokens: tuple[int, ...]
    refs: int = 0
    lora: str | None = None  # the LoRA adapter whose KV it holds (part of its key)
    # The block's hash in vLLM's scheme (app/kv_events/hashing.py), computed once, when a KV
    # event first names it (by the event publisher's thread: nothing else reads or writes it).
    digest: bytes | None = None


class CacheEventKind(Enum):
    """What a ``CacheEvent`` says: blocks stored, blocks removed, or the cache cleared."""

    STORED = 0
    REMOVED = 1
    CLEARED = 2


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """One change of the cache's contents: blocks stored (a chain's new tail, in order),
    blocks removed, or every block cleared (``blocks`` empty)."""

    kind: CacheEventKind
    blocks: tuple[CachedBlock, ...] = ()


@dataclass(slots=True)
class PrefixState:
    """A request's view of the cache. ``keys``: the chain keys of its full prompt blocks.
    ``blocks``: the entries it references (its hits, then the blocks it computed and
    published). ``checked``: its leading full prompt blocks already hit or published (a block
    another request published first stays the request's own, as in vLLM)."""

    keys: list[int]
    blocks: list[CachedBlock] = field(default_factory=list)
    checked: int = 0


class CachedRequest(Protocol):
    """What the cache reads of a request, and keeps on it (``app.engine.types.Sequence``)."""

    tokens: list[int]
    prompt_len: int
    prefilled: int
    lora: str | None
    prefix: PrefixState | None


class PrefixCache:
    """Cached prompt blocks by chain key; the free ones in least-recently-used order."""

    def __init__(self, block_size: int, record_events: bool = False) -> None:
        self.block_size = block_size
        self._entries: dict[int, CachedBlock] = {}
        self._free: OrderedDict[int, CachedBlock] = OrderedDict()  # refs == 0, LRU first
        self._events: list[CacheEvent] | None = [] if record_events else None

    def take_events(self) -> list[CacheEvent]:
        """The changes since the last call, oldest first (empty unless ``record_events``)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def blocks(self) -> list[CachedBlock]:
        """Every cached block (referenced or free)."""
        return list(self._entries.values())

    def clear_free(self) -> bool:
        """Evict every free block; True if the cache is now empty (no block was referenced),
        which is logged as one clear instead of the removals (vLLM's ``AllBlocksCleared``)."""
        if len(self._free) < len(self._entries):
            self.evict_to(0)
            return False
        self._free.clear()
        self._entries.clear()
        if self._events is not None:
            self._events.append(CacheEvent(CacheEventKind.CLEARED))
        return True

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_free(self) -> int:
        """Cached blocks no running request references (evictable: they count as free)."""
        return len(self._free)

    @property
    def num_referenced(self) -> int:
        """Cached blocks in use by running requests (each counted once)."""
        return len(self._entries) - len(self._free)

    def state(self, seq: CachedRequest) -> PrefixState:
        """``seq``'s prefix state, its prompt's chain keys computed at its first lookup."""
        if seq.prefix is None:  # an adapter's blocks chain from their own root
            size, keys = self.block_size, []
            parent = 0 if seq.lora is None else hash(("lora", seq.lora))
            prompt = seq.tokens[: seq.prompt_len]
            for start in range(0, len(prompt) - size + 1, size):
                parent = hash((parent, *prompt[start : start + size]))
                keys.append(parent)
            seq.prefix = PrefixState(keys)
        return seq.prefix

    def lookup(self, seq: CachedRequest, max_tokens: int) -> list[CachedBlock]:
        """The cached leading blocks of ``seq``'s prompt, at most ``max_tokens`` tokens' worth.
        Nothing is referenced yet (see ``acquire``)."""
        state, size, tokens = self.state(seq), self.block_size, seq.tokens
        found: list[CachedBlock] = []
        parent: CachedBlock | None = None
        for i, key in enumerate(state.keys[: max_tokens // size]):
            block = self._entries.get(key)
            if block is None or block.parent is not parent:
                break
            if block.tokens != tuple(tokens[i * size : (i + 1) * size]):
                break  # a hash collision
            found.append(block)
            parent = block
        return found

    def acquire(self, seq: CachedRequest, blocks: list[CachedBlock]) -> None:
        """``seq`` (just given a slot) starts from ``blocks``, the result of ``lookup``."""
        state = self.state(seq)
        for block in blocks:
            self._ref(block)
        state.blocks = list(blocks)
        state.checked = len(blocks)

    def publish(self, seq: CachedRequest) -> None:
        """``seq`` has computed up to ``seq.prefilled``: cache its newly full prompt blocks it
        is the first to compute (it references them from now on)."""
        state = seq.prefix
        assert state is not None
        size, tokens, keys, entries = self.block_size, seq.tokens, state.keys, self._entries
        done = min(seq.prefilled, seq.prompt_len) // size
        stored: list[CachedBlock] = []
        for i in range(state.checked, done):
            parent = entries.get(keys[i - 1]) if i else None
            if i and parent is None:
                break  # the chain is broken (its head was evicted): nothing past it is found
            block = entries.get(keys[i])
            if block is not None and block.refs == 0 and block.parent is not parent:
                self._end_run(stored)
                self._drop(block)  # a stale entry (its parent was evicted): replace it
                block = None
            if block is None:
                block = CachedBlock(keys[i], parent, tuple(tokens[i * size : (i + 1) * size]),
                                    lora=seq.lora)  # fmt: skip
                entries[keys[i]] = block
                self._ref(block)
                state.blocks.append(block)
                if self._events is not None:
                    self._stored(stored, block)
        self._end_run(stored)
        state.checked = max(state.checked, done)

    def release(self, seq: CachedRequest) -> None:
        """``seq`` left its slot: drop its references (its last block is freed first)."""
        state = seq.prefix
        if state is None:
            return
        for block in reversed(state.blocks):
            block.refs -= 1
            if block.refs == 0:
                self._free[block.key] = block
        state.blocks, state.checked = [], 0

    def evict_to(self, max_free: int) -> int:
        """Evict least recently used free blocks until at most ``max_free`` are left (the
        blocks the scheduler handed out came from the free ones). Returns how many went."""
        evicted: list[CachedBlock] = []
        while len(self._free) > max(max_free, 0):
            _, block = self._free.popitem(last=False)
            del self._entries[block.key]
            evicted.append(block)
        if evicted and self._events is not None:
            self._events.append(CacheEvent(CacheEventKind.REMOVED, tuple(evicted)))
        return len(evicted)

    def _ref(self, block: CachedBlock) -> None:
        if block.refs == 0:
            self._free.pop(block.key, None)
        block.refs += 1

    def _drop(self, block: CachedBlock) -> None:
        self._free.pop(block.key, None)
        del self._entries[block.key]
        if self._events is not None:
            self._events.append(CacheEvent(CacheEventKind.REMOVED, (block,)))

    def _stored(self, run: list[CachedBlock], block: CachedBlock) -> None:
        """Add ``block`` to the run of stored blocks being logged; a block that does not
        continue the run (its parent is not the run's last) ends it as one event."""
        if run and block.parent is not run[-1]:
            self._end_run(run)
        run.append(block)

    def _end_run(self, run: list[CachedBlock]) -> None:
        if run and self._events is not None:
            self._events.append(CacheEvent(CacheEventKind.STORED, tuple(run)))
            run.clear()
