"""The prefix cache's event log (what KV events publish) against the cache itself: after every
step of a random workload (shared prefixes, adapters, chunked prefill, a KV capacity that binds,
aborts, resets), the blocks the log says were stored minus those it says were removed are
exactly the cached blocks; each stored run is a chain; no block is removed while referenced."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from app.engine.prefix_cache import CachedBlock, CacheEventKind
from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.step import ModelOutput
from app.engine.types import Sequence

BS = 2
NEVER = 999
HEADS = ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 7, 7, 7, 7, 7, 7, 7])


class EventLogMachine(RuleBasedStateMachine):
    @initialize(kv_blocks=st.integers(4, 40), budget=st.sampled_from([None, 3, 8]),
                max_loras=st.sampled_from([None, 1, 2]))  # fmt: skip
    def start(self, kv_blocks: int, budget: int | None, max_loras: int | None) -> None:
        slots = 3
        self.scheduler = Scheduler(SchedulerConfig(
            slots, max_num_batched_tokens=None if budget is None else max(budget, slots),
            block_size=BS, kv_cache_tokens=kv_blocks * BS, enable_prefix_caching=True,
            record_kv_events=True, max_loras=max_loras, share_prompts=True,
        ))  # fmt: skip
        self.max_loras = max_loras
        self.held: set[int] = set()  # id() of the blocks the log says are cached
        self.blocks: dict[int, CachedBlock] = {}  # keeps them alive, so ids stay unique
        self.n = 0
        self.now = 0.0

    @rule(head=st.sampled_from(HEADS), tail=st.lists(st.integers(10, 20), max_size=5),
          out=st.integers(1, 4), lora=st.sampled_from([None, "a", "b"]),
          choices=st.integers(1, 3))  # fmt: skip
    def arrive(
        self, head: list[int], tail: list[int], out: int, lora: str | None, choices: int
    ) -> None:
        """A request with ``choices`` choices (those after the first fork from it)."""
        lora = lora if self.max_loras else None
        first: Sequence | None = None
        for _ in range(choices):
            self.n += 1
            seq = Sequence(f"r{self.n}", [*head, *tail], out, frozenset({NEVER}), lora=lora,
                           fork_of=first)  # fmt: skip
            self.scheduler.add(seq, self.now)
            first = first or seq

    @precondition(lambda self: self.scheduler.has_work())
    @rule(pick=st.integers(0, 100))
    def abort(self, pick: int) -> None:
        live = [*self.scheduler.waiting, *self.scheduler.slots.running()]
        self.scheduler.abort(live[pick % len(live)].request_id, self.now)
        self.read_log()

    @rule()
    def step(self) -> None:
        self.now += 1
        out = self.scheduler.schedule(self.now)
        if any(chunk.prefix_slot is not None for chunk in out.prefills):
            note_event("fork")
        if not out.empty:
            self.scheduler.update(out, ModelOutput([5] * out.num_outputs), self.now)
        self.read_log()

    @rule()
    def reset(self) -> None:
        cache = self.scheduler.prefix_cache
        assert cache is not None
        emptied = cache.clear_free()
        self.read_log()
        assert emptied == (not cache.blocks())

    def read_log(self) -> None:
        cache = self.scheduler.prefix_cache
        assert cache is not None
        for event in cache.take_events():
            ids = {id(block) for block in event.blocks}
            if event.kind is CacheEventKind.STORED:
                assert not ids & self.held
                first = event.blocks[0]
                assert first.parent is None or id(first.parent) in self.held
                for parent, child in zip(event.blocks, event.blocks[1:], strict=False):
                    assert child.parent is parent  # a run is a chain
                self.held |= ids
                self.blocks.update((id(block), block) for block in event.blocks)
            elif event.kind is CacheEventKind.REMOVED:
                assert ids <= self.held
                assert all(block.refs == 0 for block in event.blocks)
                self.held -= ids
            else:
                self.held.clear()

    @invariant()
    def the_books_hold(self) -> None:
        """Forks included, the running requests' blocks fit the cache and a cached block's
        references are exactly the running requests that hold it."""
        if not hasattr(self, "scheduler"):
            return
        scheduler = self.scheduler
        running = scheduler.slots.running()
        assert scheduler.books.used(running) <= scheduler.books.total
        cache = scheduler.prefix_cache
        assert cache is not None
        for block in cache.blocks():
            holders = [s for s in running if s.prefix and any(b is block for b in s.prefix.blocks)]
            assert block.refs == len(holders)

    @invariant()
    def the_log_is_the_cache(self) -> None:
        if hasattr(self, "scheduler"):
            self.read_log()
            cache = self.scheduler.prefix_cache
            assert cache is not None
            assert self.held == {id(block) for block in cache.blocks()}

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for _ in range(500):
            if not self.scheduler.has_work():
                break
            self.step()
        assert not self.scheduler.has_work()


TestEventLog = EventLogMachine.TestCase
TestEventLog.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
