"""A hypothesis state machine driving ``EngineCore`` step by step, without an event loop, the way
the asyncio engine does: ``out = schedule()``, run the model, ``update()`` (or ``fail()``), with
submits, aborts and preemptions interleaved anywhere, including between a request's admission
and its first output. Run against both the stateless and the KV-cache mock, both batching
policies, token budgets and prefill chunk caps small enough to chunk prompts, and KV capacities
small enough to preempt.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from reference import run_alone

from app.engine.core import EngineConfig, EngineCore
from app.engine.errors import DuplicateRequestError, QueueFullError
from app.engine.runner import make_runner
from app.engine.scheduler import BatchingPolicy
from app.engine.step import ModelOutput, SchedulerOutput, StepOutcome
from app.engine.stream import Delta, RequestStream
from app.engine.types import FinishReason, RequestStatus, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage

VOCAB = 12
STOP = 3
LANGUAGE = MockLanguage(text=False, vocab_size=VOCAB, stop_token=STOP, stop_probability=0.15)
IDS = ["a", "b", "c", "d", "e"]  # a small pool: ids are reused once their request has ended
REFERENCE_MODEL = MockModel(LANGUAGE)


class InjectedModelFailure(RuntimeError):
    pass


def reference(prompt: tuple[int, ...], max_tokens: int, include_stop: bool) -> list[int]:
    """The request run alone on the stateless mock."""
    return run_alone(REFERENCE_MODEL, list(prompt), max_tokens, STOP, include_stop)


class CountingObserver:
    def __init__(self) -> None:
        self.finished: Counter[int] = Counter()
        self.steps: list[StepOutcome] = []

    def on_step(self, outcome: StepOutcome) -> None:
        self.steps.append(outcome)

    def on_finished(self, seq: Sequence) -> None:
        self.finished[id(seq)] += 1


def poll(stream: RequestStream) -> Delta | None:
    """Take the next delta without an event loop (only when one is ready); None at the end."""
    coro: Coroutine[Any, Any, Delta] = stream.__anext__()
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except StopAsyncIteration:
        return None
    coro.close()
    raise AssertionError("the stream would block although it had output")


class Tracked:
    """A submitted request, its stream and how much of it the test has read."""

    def __init__(self, seq: Sequence, stream: RequestStream) -> None:
        self.seq, self.stream = seq, stream
        self.read = 0
        self.ended = False  # the delta with the finish reason was read
        self.expected = reference(tuple(seq.prompt), seq.max_tokens, seq.include_stop)
        self.admitted: float | None = None  # the first admission and first token times seen:
        self.first_token: float | None = None  # a resume must not move them

    def readable(self) -> bool:
        return not self.ended and (self.seq.num_generated > self.read or self.seq.finished)


MAX_COMPUTED = 4 + 6 - 1  # the most tokens a request computes: a 4-token prompt, 6 generated


class EngineCoreMachine(RuleBasedStateMachine):
    core: EngineCore
    num_slots: int
    max_waiting: int
    policy: BatchingPolicy
    budget: int | None
    chunk_cap: int | None
    model: MockModel | CachedMockModel

    def __init__(self) -> None:
        super().__init__()
        self.observer = CountingObserver()
        self.requests: list[Tracked] = []
        self.injected: set[int] = set()  # id() of errors this test injected

    @initialize(
        num_slots=st.integers(1, 4),
        max_waiting=st.integers(0, 3),
        cached=st.booleans(),
        static=st.booleans(),
        extra_budget=st.none() | st.integers(0, 6),
        chunk_cap=st.none() | st.integers(1, 4),
        block_size=st.integers(1, 4),
        extra_blocks=st.none() | st.integers(0, 4),
    )
    def setup(
        self,
        num_slots: int,
        max_waiting: int,
        cached: bool,
        static: bool,
        extra_budget: int | None,
        chunk_cap: int | None,
        block_size: int,
        extra_blocks: int | None,
    ) -> None:
        """``extra_budget``: the token budget beyond one token per slot (None: no budget).
        ``extra_blocks``: KV blocks beyond what the longest request needs alone (None: no KV
        limit), so every request fits the cache alone but not always together."""
        self.num_slots, self.max_waiting = num_slots, max_waiting
        self.policy = BatchingPolicy.STATIC if static else BatchingPolicy.CONTINUOUS
        self.budget = None if extra_budget is None else num_slots + extra_budget
        self.chunk_cap = chunk_cap
        kv_tokens = None
        if extra_blocks is not None:
            kv_tokens = (-(-MAX_COMPUTED // block_size) + extra_blocks) * block_size
        self.model = CachedMockModel(num_slots, LANGUAGE) if cached else MockModel(LANGUAGE)
        config = EngineConfig(
            num_slots=num_slots,
            max_waiting=max_waiting,
            batching=self.policy,
            max_num_batched_tokens=self.budget,
            max_prefill_chunk=chunk_cap,
            block_size=block_size,
            kv_cache_tokens=kv_tokens,
        )
        self.core = EngineCore(make_runner(self.model, num_slots), config, self.observer)

    # --- rules ----------------------------------------------------------------------------

    @rule(
        specs=st.lists(
            st.tuples(
                st.sampled_from(IDS),
                st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
                st.integers(0, 6),
                st.booleans(),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def submit(self, specs: list[tuple[str, list[int], int, bool]]) -> None:
        """One or more requests arrive (between two steps)."""
        for rid, prompt, max_tokens, include_stop in specs:
            self._submit(rid, prompt, max_tokens, include_stop)

    @precondition(lambda self: hasattr(self, "core") and self._finished_ids())
    @rule(
        data=st.data(),
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
        max_tokens=st.integers(1, 6),
    )
    def reuse_the_id_of_a_finished_request(
        self, data: st.DataObject, prompt: list[int], max_tokens: int
    ) -> None:
        rid = data.draw(st.sampled_from(self._finished_ids()))
        self._submit(rid, prompt, max_tokens, include_stop=False)

    @precondition(lambda self: hasattr(self, "core") and self.core.live)
    @rule(data=st.data())
    def submit_a_live_id_again(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.core.live)))
        self._submit(rid, [1], 3, include_stop=False)

    @rule(
        data=st.data(),
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
        max_tokens=st.integers(0, 6),
        n=st.integers(2, 3),
    )
    def submit_choices(
        self, data: st.DataObject, prompt: list[int], max_tokens: int, n: int
    ) -> None:
        """A request with ``n`` choices: every one after the first forks from the first (it
        starts from a copy of the first one's prompt cache once that one decodes), or, when
        the first was refused or has ended, prefills alone; the outputs are the same."""
        ids = data.draw(st.lists(st.sampled_from(IDS), min_size=n, max_size=n, unique=True))
        first = self._submit(ids[0], prompt, max_tokens, include_stop=False)
        for rid in ids[1:]:
            self._submit(rid, prompt, max_tokens, include_stop=False, fork_of=first)

    def _submit(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int,
        include_stop: bool,
        fork_of: Sequence | None = None,
    ) -> Sequence:
        core = self.core
        seq = Sequence(rid, list(prompt), max_tokens, frozenset({STOP}), include_stop=include_stop,
                       fork_of=fork_of)  # fmt: skip
        if rid in core.live:
            before = core.live[rid]
            with pytest.raises(DuplicateRequestError):
                core.register(seq)
            assert core.live[rid] is before
            return seq
        if len(core.live) >= self.num_slots + self.max_waiting:  # every slot and queue place
            with pytest.raises(QueueFullError):
                core.register(seq)
            assert rid not in core.live
            return seq
        stream = core.register(seq)
        core.add(seq)
        self.requests.append(Tracked(seq, stream))
        if max_tokens == 0:
            assert seq.finish_reason is FinishReason.LENGTH and rid not in core.live
        return seq

    def _finished_ids(self) -> list[str]:
        return sorted({t.seq.request_id for t in self.requests} - set(self.core.live))

    @rule(rid=st.sampled_from([*IDS, "ghost"]))
    def abort(self, rid: str) -> None:
        stream = self.core.live.get(rid)
        self.core.abort(rid)
        if stream is not None:
            assert stream.seq.finish_reason is FinishReason.ABORT
            assert stream.seq.slot is None
        assert rid not in self.core.live

    @precondition(lambda self: hasattr(self, "core") and self.core.live)
    @rule(data=st.data())
    def abort_a_live_request(self, data: st.DataObject) -> None:
        self.abort(data.draw(st.sampled_from(sorted(self.core.live))))

    @rule()
    def step(self) -> None:
        out = self._schedule()
        if not out.empty:
            self._update(out, self.core.runner.execute(out))

    @precondition(lambda self: hasattr(self, "core") and self.core.num_running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """A running request (prefilling or decoding) is preempted between two steps: it gives
        its slot and blocks back and waits at the front of the queue. When it resumes it
        recomputes prompt + generated tokens and goes on as if nothing happened (checked by the
        reference and stream invariants)."""
        scheduler = self.core.scheduler
        seq = data.draw(st.sampled_from(list(scheduler.slots.running())))
        generated, preemptions = list(seq.generated), seq.num_preemptions
        times = (seq.times.admitted, seq.times.first_token)
        scheduler.preempt(seq, self.core.clock())
        assert seq.status is RequestStatus.PREEMPTED and seq.slot is None
        assert seq.num_computed_tokens == 0 and seq.num_preemptions == preemptions + 1
        assert scheduler.waiting.peek() is seq
        assert seq.generated == generated and not seq.finished
        assert (seq.times.admitted, seq.times.first_token) == times

    @precondition(lambda self: hasattr(self, "core") and self.core.live)
    @rule(data=st.data())
    def step_with_abort_before_output(self, data: st.DataObject) -> None:
        """Aborts that arrive while the model runs (the engine applies them before the call's
        tokens): the aborted request gets none of the call's tokens and its slot is free."""
        out = self._schedule()
        if out.empty:
            return
        tokens = self.core.runner.execute(out)
        victims = data.draw(st.lists(st.sampled_from(out.scheduled()), unique_by=id, min_size=1))
        before = {id(seq): seq.num_generated for seq in victims}
        for seq in victims:
            self.core.abort(seq.request_id)
        self._update(out, tokens)
        for seq in victims:
            assert seq.finish_reason is FinishReason.ABORT
            assert seq.num_generated == before[id(seq)]
            if seq in out.admitted:
                assert seq.generated == []

    @precondition(lambda self: hasattr(self, "core") and self.core.num_running)
    @rule(data=st.data())
    def step_with_preempt_before_output(self, data: st.DataObject) -> None:
        """Preemptions while the model runs: the preempted requests get none of the call's
        tokens (they recompute them when they resume) and hold no blocks."""
        out = self._schedule()
        if out.empty:
            return
        tokens = self.core.runner.execute(out)
        victims = data.draw(st.lists(st.sampled_from(out.scheduled()), unique_by=id, min_size=1))
        before = {id(seq): list(seq.generated) for seq in victims}
        for seq in victims:
            self.core.scheduler.preempt(seq, self.core.clock())
        self._update(out, tokens)
        for seq in victims:
            assert seq.status is RequestStatus.PREEMPTED and seq.generated == before[id(seq)]
            assert seq.num_computed_tokens == 0 and seq.slot is None

    @precondition(lambda self: hasattr(self, "core") and self.core.live)
    @rule(model_ran=st.booleans())
    def failing_step(self, model_ran: bool) -> None:
        """The model call fails, before doing anything or after its work (a bad output)."""
        out = self._schedule()
        if out.empty:
            return
        if model_ran:
            self.core.runner.execute(out)
        err = InjectedModelFailure("injected")
        self.injected.add(id(err))
        in_call = [seq for seq in out.scheduled() if not seq.finished]
        others = {id(t.seq): t.seq.num_generated for t in self.requests if not t.seq.finished}
        steps = len(self.observer.steps)
        self.core.fail(out, err)
        assert len(self.observer.steps) == steps + 1
        for seq in in_call:
            assert seq.finish_reason is FinishReason.ERROR and seq.error is err
        for tracked in self.requests:  # nobody outside the call is touched
            seq = tracked.seq
            if id(seq) in others and seq not in in_call:
                assert not seq.finished and seq.num_generated == others[id(seq)]

    @rule()
    def abort_waiting(self) -> None:
        """A drain: every waiting request ends, but the forks of a running request (part of
        a request that runs: it may finish within the grace)."""
        waiting = [t.seq for t in self.requests if not t.seq.finished and t.seq.slot is None]
        running = [t.seq for t in self.requests if t.seq.slot is not None]
        kept = [s for s in waiting if s.fork_of and s.fork_of.status is RequestStatus.RUNNING]
        self.core.abort_waiting()
        assert all(seq.finish_reason is FinishReason.ABORT for seq in waiting if seq not in kept)
        assert all(not seq.finished and seq.request_id in self.core.scheduler.waiting
                   for seq in kept)  # fmt: skip
        assert all(not seq.finished and seq.slot is not None for seq in running)

    @precondition(lambda self: any(t.readable() for t in self.requests))
    @rule(data=st.data())
    def read_stream(self, data: st.DataObject) -> None:
        tracked = data.draw(st.sampled_from([t for t in self.requests if t.readable()]))
        self._read(tracked)

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def slot_table_is_consistent(self) -> None:
        if not hasattr(self, "core"):
            return
        table = self.core.scheduler.slots
        assert table.num_free + table.occupied == table.capacity == self.num_slots
        held = [table.get(i) for i in range(table.capacity)]
        assert sum(seq is not None for seq in held) == table.occupied
        for i, seq in enumerate(held):
            if seq is not None:
                assert seq.slot == i and not seq.finished  # no slot holds a finished sequence

    @invariant()
    def live_is_exactly_the_unfinished_requests(self) -> None:
        if not hasattr(self, "core"):
            return
        unfinished = {t.seq.request_id: t.seq for t in self.requests if not t.seq.finished}
        assert set(self.core.live) == set(unfinished)
        for rid, stream in self.core.live.items():
            assert stream.seq is unfinished[rid]
        for seq in unfinished.values():  # each one is either waiting or in a slot
            assert (seq.slot is not None) != (seq.request_id in self.core.scheduler.waiting)
        assert self.core.num_waiting == len(self.core.scheduler.waiting)
        assert self.core.num_running == self.core.scheduler.slots.occupied

    @invariant()
    def kv_books_hold(self) -> None:
        """Running requests hold ``ceil(computed / block_size)`` blocks, within the capacity;
        nothing else holds any. A cached model's cache holds exactly the computed tokens."""
        if not hasattr(self, "core"):
            return
        scheduler = self.core.scheduler
        books, running = scheduler.books, scheduler.slots.running()
        used = books.used(running)
        assert used == sum(books.blocks_for(seq.num_computed_tokens) for seq in running)
        assert 0 <= used <= books.total
        for tracked in self.requests:
            seq = tracked.seq
            if seq.status is RequestStatus.RUNNING:
                computed = seq.prefilled if seq.prefilling else len(seq.tokens) - 1
                assert seq.num_computed_tokens == computed
                assert seq.num_generated == 0 or not seq.prefilling or seq.num_preemptions
            else:
                assert seq.num_computed_tokens == 0 and seq.slot is None
        if isinstance(self.model, CachedMockModel):
            held = set(self.model.held_slots())
            for seq in running:
                assert seq.slot is not None
                if seq.num_computed_tokens:
                    assert seq.slot in held
                    assert self.model.cached_tokens(seq.slot) == seq.num_computed_tokens

    @invariant()
    def every_request_ends_exactly_once(self) -> None:
        for tracked in self.requests:
            expected = 1 if tracked.seq.finished else 0
            assert self.observer.finished[id(tracked.seq)] == expected

    @invariant()
    def outputs_agree_with_the_sequential_reference(self) -> None:
        for tracked in self.requests:
            seq, expected = tracked.seq, tracked.expected
            assert seq.num_generated <= seq.max_tokens
            if seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                assert seq.generated == expected
                assert seq.error is None
            else:  # running, waiting, aborted or failed: a prefix of what it would have been
                assert seq.generated == expected[: seq.num_generated]
            if seq.finish_reason is FinishReason.ERROR:
                assert id(seq.error) in self.injected
            if seq.finish_reason is FinishReason.ABORT:
                assert seq.error is None

    @invariant()
    def timestamps_are_ordered(self) -> None:
        for tracked in self.requests:
            times = tracked.seq.times
            marks = [times.arrival, times.admitted, times.first_token, times.finished]
            present = [m for m in marks if m is not None]
            assert present == sorted(present)
            assert (times.finished is not None) == tracked.seq.finished
            if tracked.admitted is not None:
                assert times.admitted == tracked.admitted
            if tracked.first_token is not None:
                assert times.first_token == tracked.first_token
            tracked.admitted, tracked.first_token = times.admitted, times.first_token
            assert (times.first_token is None) == (tracked.seq.num_generated == 0) or (
                tracked.seq.include_stop is False and tracked.seq.finish_reason is FinishReason.STOP
            )

    # --- helpers ---------------------------------------------------------------------------

    def _schedule(self) -> SchedulerOutput:
        scheduler = self.core.scheduler
        waiting_before = len(scheduler.waiting)
        running_before = self.core.num_running
        out = self.core.schedule()
        # requests holding slots always make progress (no KV deadlock between prefills)
        assert not out.empty or not self.core.num_running
        for name, happened in [
            ("preempted", out.preempted),
            ("resumed", out.resumed),
            ("partial prefill chunk", [c for c in out.prefills if not c.sample]),
            ("fork", [c for c in out.prefills if c.prefix_slot is not None]),
        ]:
            if happened:
                event(name)
        scheduled = out.scheduled()
        running = scheduler.slots.running()
        assert len(scheduled) <= self.num_slots and len(set(map(id, scheduled))) == len(scheduled)
        assert all(seq.status is RequestStatus.RUNNING for seq in scheduled)
        assert [seq.slot for seq in out.decode_seqs] == sorted(s.slot for s in out.decode_seqs)  # type: ignore[type-var]
        # every request past its prefill decodes in every step, and is fed its last token
        assert out.decode_seqs == [seq for seq in running if not seq.prefilling]
        assert out.decode_tokens == [seq.tokens[-1] for seq in out.decode_seqs]
        # a request enters a slot with its first chunk (static batching fills every slot at
        # once, so there a slot may wait for the budget of a later step)
        if self.policy is not BatchingPolicy.STATIC:
            assert all(seq in out.prefill_seqs for seq in out.admitted + out.resumed)
        assert all(seq.num_preemptions == 0 for seq in out.admitted)
        assert all(seq.num_preemptions > 0 for seq in out.resumed)
        # the token budget and the chunk cap
        if self.budget is not None:
            assert out.num_prefill_tokens + out.num_decode_tokens <= self.budget
        for seq, chunk in zip(out.prefill_seqs, out.prefills, strict=True):
            assert 0 < len(chunk.token_ids) <= (self.chunk_cap or len(chunk.token_ids))
            assert chunk.slot == seq.slot and chunk.start == seq.num_computed_tokens
            assert chunk.token_ids == seq.tokens[chunk.start : chunk.start + len(chunk.token_ids)]
            assert chunk.sample == (chunk.start + len(chunk.token_ids) == len(seq.tokens))
        assert out.num_prefill_tokens == sum(len(c.token_ids) for c in out.prefills)
        for chunk in out.prefills:  # a fork copies its prompt but the last token from its
            if chunk.prefix_slot is not None:  # source's slot, which still holds it
                source = scheduler.slots.get(chunk.prefix_slot)
                assert source is not None and not source.prefilling
                assert source.tokens[: chunk.start] == list(chunk.prefix)
                assert chunk.sample and chunk.start == len(chunk.prefix) == source.prompt_len - 1
        awaiting = sum(1 for seq in scheduler.waiting if seq.awaits_fork)
        if self.policy is BatchingPolicy.STATIC and (out.admitted or out.resumed):
            assert running_before == 0 or running_before == len(out.preempted)
        if self.policy is BatchingPolicy.CONTINUOUS and not self._limited(out):
            # no slot sits empty while a request waits
            expected = min(self.num_slots, running_before + waiting_before - awaiting)
            assert scheduler.slots.occupied == expected
        return out

    def _limited(self, out: SchedulerOutput) -> bool:
        """Whether the budget or the KV cache may have kept a waiting request out."""
        spent = out.num_prefill_tokens + out.num_decode_tokens
        return (
            self.budget is not None and spent >= self.budget
        ) or self.core.config.kv_cache_tokens is not None

    def _update(self, out: SchedulerOutput, result: ModelOutput) -> None:
        steps = len(self.observer.steps)
        self.core.update(out, result)
        assert len(self.observer.steps) == steps + 1
        self.kv_books_hold()

    def _read(self, tracked: Tracked) -> None:
        delta = poll(tracked.stream)
        assert delta is not None
        seq = tracked.seq
        # one delta holds everything generated since the previous read
        assert delta.tokens == seq.generated[tracked.read :]
        tracked.read = seq.num_generated
        if delta.finish_reason is None:
            assert delta.tokens and not seq.finished
        else:
            assert delta.finish_reason is seq.finish_reason and delta.error is seq.error
            tracked.ended = True
            assert poll(tracked.stream) is None  # nothing after the final delta

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for _ in range(10 * (len(self.requests) + 1)):  # every request needs <= 6 steps
            if not self.core.scheduler.has_work():
                break
            self.step()
        assert not self.core.scheduler.has_work() and not self.core.live
        self.slot_table_is_consistent()
        self.every_request_ends_exactly_once()
        self.outputs_agree_with_the_sequential_reference()
        for tracked in self.requests:
            if not tracked.ended:
                self._read(tracked)
            assert tracked.read == tracked.seq.num_generated


EngineCoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineCore = EngineCoreMachine.TestCase
