"""The engine contract's end-to-end property (issue 8): whatever the token budget (>= the slot
count), the prefill chunk cap, the slot count and the KV capacity, on the stateless and the
cached mock, with aborts and preemptions at random steps, every request that is not aborted gets
exactly the tokens it gets when run alone (tests/reference.py), and a reader polling its stream
never sees a token twice nor misses one, across preemptions too. Each step stays within the
budget and the chunk cap, and the KV books hold.

``EngineCore`` is driven step by step without an event loop, as the asyncio engine drives it.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from reference import run_alone

from app.engine.core import EngineConfig, EngineCore
from app.engine.runner import make_runner
from app.engine.step import SchedulerOutput
from app.engine.stream import Delta, RequestStream
from app.engine.types import FinishReason, RequestStatus, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage

VOCAB = 12
STOP = 3
LANGUAGE = MockLanguage(text=False, vocab_size=VOCAB, stop_token=STOP, stop_probability=0.1)
REFERENCE_MODEL = MockModel(LANGUAGE)
MAX_STEPS = 2_000


@dataclass(frozen=True)
class Spec:
    prompt: list[int]
    max_tokens: int
    include_stop: bool
    arrival: int  # the step before which it is submitted


@dataclass(frozen=True)
class Scenario:
    num_slots: int
    budget: int | None
    chunk_cap: int | None
    block_size: int
    extra_blocks: int | None  # KV blocks beyond the longest request's (None: no KV limit)
    cached: bool
    specs: list[Spec]
    # step -> (request index, during the step's model call?) to abort / to preempt; an event
    # not during the call happens before the step is scheduled
    aborts: dict[int, list[tuple[int, bool]]]
    preempts: dict[int, list[tuple[int, bool]]]
    readers: list[int]  # request i's reader polls every readers[i] steps

    def kv_cache_tokens(self) -> int | None:
        """Enough for the longest request alone, plus ``extra_blocks``: small enough that
        requests running together must be preempted."""
        if self.extra_blocks is None:
            return None
        longest = max(1, *(len(s.prompt) + s.max_tokens - 1 for s in self.specs))
        return (-(-longest // self.block_size) + self.extra_blocks) * self.block_size


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    num_slots = draw(st.integers(1, 4))
    n = draw(st.integers(1, 8))
    specs = [
        Spec(
            draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)),
            draw(st.integers(0, 8)),
            draw(st.booleans()),
            draw(st.integers(0, 6)),
        )
        for _ in range(n)
    ]
    events = st.dictionaries(
        st.integers(0, 30), st.lists(st.tuples(st.integers(0, n - 1), st.booleans()), max_size=2)
    )
    return Scenario(
        num_slots=num_slots,
        budget=draw(st.none() | st.integers(num_slots, num_slots + 16)),
        chunk_cap=draw(st.none() | st.integers(1, 8)),
        block_size=draw(st.integers(1, 4)),
        extra_blocks=draw(st.none() | st.integers(0, 3)),
        cached=draw(st.booleans()),
        specs=specs,
        aborts=draw(events),
        preempts=draw(events),
        readers=draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)),
    )


def poll(stream: RequestStream) -> Delta | None:
    """The next delta, without an event loop (call it only when one is ready); None once the
    stream has ended."""
    coro: Coroutine[Any, Any, Delta] = stream.__anext__()
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except StopAsyncIteration:
        return None
    coro.close()
    raise AssertionError("the stream would block although it had output")


@dataclass
class Reader:
    """What a client polling one request's stream has seen."""

    seq: Sequence
    stream: RequestStream
    every: int
    tokens: list[int] = field(default_factory=list)
    deltas: int = 0
    ended: bool = False

    def read(self) -> None:
        if self.ended or (len(self.tokens) == self.seq.num_generated and not self.seq.finished):
            return  # nothing new: a poll would block
        delta = poll(self.stream)
        if delta is None:
            return
        self.deltas += 1
        # exactly the tokens generated since the previous read: none twice, none missing
        assert delta.tokens == self.seq.generated[len(self.tokens) :]
        assert delta.tokens or delta.finish_reason is not None
        self.tokens += delta.tokens
        if delta.finish_reason is not None:
            assert delta.finish_reason is self.seq.finish_reason
            self.ended = True


class Run:
    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.model = CachedMockModel(scenario.num_slots, LANGUAGE) if scenario.cached else None
        config = EngineConfig(
            num_slots=scenario.num_slots,
            max_waiting=len(scenario.specs),
            max_num_batched_tokens=scenario.budget,
            max_prefill_chunk=scenario.chunk_cap,
            block_size=scenario.block_size,
            kv_cache_tokens=scenario.kv_cache_tokens(),
        )
        model = self.model or MockModel(LANGUAGE)
        self.core = EngineCore(make_runner(model, scenario.num_slots), config)
        self.readers: list[Reader | None] = [None] * len(scenario.specs)
        self.aborted: set[int] = set()
        self.explicit: set[str] = set()  # ids of requests this test preempted

    def go(self) -> None:
        core, last_arrival = self.core, max(spec.arrival for spec in self.s.specs)
        for step in range(MAX_STEPS):
            self.arrive(step)
            self.interfere(step, in_call=False)
            for reader in self.readers:
                if reader is not None and step % reader.every == 0:
                    reader.read()
            if step > last_arrival and not core.scheduler.has_work():
                return
            out = self.schedule()
            if not out.empty:
                result = core.runner.execute(out)
                self.interfere(step, in_call=True)
                core.update(out, result)
                self.check_books()
        raise AssertionError(f"not done after {MAX_STEPS} steps")

    def arrive(self, step: int) -> None:
        for i, spec in enumerate(self.s.specs):
            if spec.arrival == step:
                seq = Sequence(
                    f"r{i}", list(spec.prompt), spec.max_tokens, frozenset({STOP}),
                    include_stop=spec.include_stop,
                )  # fmt: skip
                stream = self.core.register(seq)
                self.core.add(seq)
                self.readers[i] = Reader(seq, stream, self.s.readers[i])

    def interfere(self, step: int, in_call: bool) -> None:
        """This step's aborts and preemptions (of requests that can take them), before the
        step or while its model call runs."""
        for i, during in self.s.aborts.get(step, []):
            reader = self.readers[i]
            if during == in_call and reader is not None and not reader.seq.finished:
                self.core.abort(reader.seq.request_id)
                self.aborted.add(i)
        for i, during in self.s.preempts.get(step, []):
            reader = self.readers[i]
            if during != in_call or reader is None:
                continue
            if reader.seq.status is RequestStatus.RUNNING:
                self.core.scheduler.preempt(reader.seq, self.core.clock())
                self.explicit.add(reader.seq.request_id)
                event(f"explicit preemption{' during a model call' if in_call else ''}")

    def schedule(self) -> SchedulerOutput:
        core, s = self.core, self.s
        out = core.schedule()
        assert not out.empty or not core.num_running  # running requests always make progress
        if any(seq.request_id not in self.explicit for seq in out.preempted):
            event("preempted for KV")
        self.explicit.clear()
        if out.resumed:
            event("resumed")
        if any(not chunk.sample for chunk in out.prefills):
            event("chunked prefill")
        if s.budget is not None:
            assert out.num_prefill_tokens + out.num_decode_tokens <= s.budget
        for chunk in out.prefills:
            assert 0 < len(chunk.token_ids) <= (s.chunk_cap or len(chunk.token_ids))
        running = core.scheduler.slots.running()
        assert out.decode_seqs == [seq for seq in running if not seq.prefilling]
        return out

    def check_books(self) -> None:
        scheduler = self.core.scheduler
        books, running = scheduler.books, scheduler.slots.running()
        used = books.used(running)
        assert 0 <= used <= books.total
        assert used == sum(-(-seq.num_computed_tokens // books.block_size) for seq in running)
        for reader in self.readers:
            if reader is not None and reader.seq.status is not RequestStatus.RUNNING:
                assert reader.seq.num_computed_tokens == 0
        if self.model is not None:
            for seq in running:
                if seq.num_computed_tokens:
                    assert seq.slot is not None
                    assert self.model.cached_tokens(seq.slot) == seq.num_computed_tokens

    def check_results(self) -> None:
        for i, (spec, reader) in enumerate(zip(self.s.specs, self.readers, strict=True)):
            assert reader is not None
            seq = reader.seq
            while not reader.ended:
                reader.read()
            assert reader.tokens == seq.generated
            assert reader.deltas <= len(seq.generated) + 1
            expected = run_alone(
                REFERENCE_MODEL, spec.prompt, spec.max_tokens, STOP, spec.include_stop
            )
            if i in self.aborted and seq.finish_reason is FinishReason.ABORT:
                assert seq.generated == expected[: seq.num_generated]
            else:
                assert seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                assert seq.generated == expected
        assert not self.core.live
        if self.model is not None:
            self.core.runner.close()
            assert self.model.held_slots() == []


KV_DEADLOCK = Scenario(  # prefills that fill the KV cache between them (was a deadlock)
    num_slots=2,
    budget=4,
    chunk_cap=2,
    block_size=2,
    extra_blocks=0,
    cached=True,
    specs=[Spec([1, 2, 4, 5, 6, 7], 3, False, 0), Spec([2, 1, 4, 5, 6, 7], 3, False, 0)],
    aborts={},
    preempts={},
    readers=[1, 2],
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
@example(scenario=KV_DEADLOCK)
def test_every_schedule_gives_each_request_its_sequential_tokens(scenario: Scenario) -> None:
    run = Run(scenario)
    run.go()
    run.check_results()
