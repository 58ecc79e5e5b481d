"""A hypothesis state machine driving ``EngineCore`` step by step, without an event loop, the way
the asyncio engine does: ``plan = schedule()``, run the model, ``complete()`` (or ``fail()``),
with submits and aborts interleaved anywhere, including between a plan's admission and its
first output. Run against both the stateless and the KV-cache mock, and both batching policies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
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
from app.engine.scheduler import BatchingPolicy, StepPlan
from app.engine.stream import Delta, RequestStream
from app.engine.types import FinishReason, Sequence
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
        self.steps: list[StepPlan] = []

    def on_step(self, plan: StepPlan, ended: float) -> None:
        self.steps.append(plan)

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

    def readable(self) -> bool:
        return not self.ended and (self.seq.num_generated > self.read or self.seq.finished)


class EngineCoreMachine(RuleBasedStateMachine):
    core: EngineCore
    num_slots: int
    max_waiting: int
    policy: BatchingPolicy

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
    )
    def setup(self, num_slots: int, max_waiting: int, cached: bool, static: bool) -> None:
        self.num_slots, self.max_waiting = num_slots, max_waiting
        self.policy = BatchingPolicy.STATIC if static else BatchingPolicy.CONTINUOUS
        model = CachedMockModel(num_slots, LANGUAGE) if cached else MockModel(LANGUAGE)
        config = EngineConfig(num_slots=num_slots, max_waiting=max_waiting, policy=self.policy)
        self.core = EngineCore(make_runner(model, num_slots), config, self.observer)

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

    def _submit(self, rid: str, prompt: list[int], max_tokens: int, include_stop: bool) -> None:
        core = self.core
        seq = Sequence(rid, prompt, max_tokens, frozenset({STOP}), include_stop=include_stop)
        if rid in core.live:
            before = core.live[rid]
            with pytest.raises(DuplicateRequestError):
                core.register(seq)
            assert core.live[rid] is before
            return
        if len(core.live) >= self.num_slots + self.max_waiting:  # every slot and queue place
            with pytest.raises(QueueFullError):
                core.register(seq)
            assert rid not in core.live
            return
        stream = core.register(seq)
        core.add(seq)
        self.requests.append(Tracked(seq, stream))
        if max_tokens == 0:
            assert seq.finish_reason is FinishReason.LENGTH and rid not in core.live

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
        plan = self._schedule()
        if plan.batch:
            self._complete(plan, self.core.runner.execute(plan))

    @precondition(lambda self: hasattr(self, "core") and self.core.live)
    @rule(data=st.data())
    def step_with_abort_before_output(self, data: st.DataObject) -> None:
        """Aborts that arrive while the model runs (the engine applies them before the call's
        tokens): the aborted request gets none of the call's tokens and its slot is free."""
        plan = self._schedule()
        if not plan.batch:
            return
        tokens = self.core.runner.execute(plan)
        victims = data.draw(st.lists(st.sampled_from(plan.batch), unique_by=id, min_size=1))
        before = {id(seq): seq.num_generated for seq in victims}
        for seq in victims:
            self.core.abort(seq.request_id)
        self._complete(plan, tokens)
        for seq in victims:
            assert seq.finish_reason is FinishReason.ABORT
            assert seq.num_generated == before[id(seq)]
            if seq in plan.admitted:
                assert seq.generated == []

    @precondition(lambda self: hasattr(self, "core") and self.core.live)
    @rule(model_ran=st.booleans())
    def failing_step(self, model_ran: bool) -> None:
        """The model call fails, before doing anything or after its work (a bad output)."""
        plan = self._schedule()
        if not plan.batch:
            return
        if model_ran:
            self.core.runner.execute(plan)
        err = InjectedModelFailure("injected")
        self.injected.add(id(err))
        in_call = [seq for seq in plan.batch if not seq.finished]
        others = {id(t.seq): t.seq.num_generated for t in self.requests if not t.seq.finished}
        steps = len(self.observer.steps)
        self.core.fail(plan, err)
        assert len(self.observer.steps) == steps + 1
        for seq in in_call:
            assert seq.finish_reason is FinishReason.ERROR and seq.error is err
        for tracked in self.requests:  # nobody outside the call is touched
            seq = tracked.seq
            if id(seq) in others and seq not in in_call:
                assert not seq.finished and seq.num_generated == others[id(seq)]

    @rule()
    def abort_waiting(self) -> None:
        waiting = [t.seq for t in self.requests if not t.seq.finished and t.seq.slot is None]
        running = [t.seq for t in self.requests if t.seq.slot is not None]
        self.core.abort_waiting()
        assert all(seq.finish_reason is FinishReason.ABORT for seq in waiting)
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

    # --- helpers ---------------------------------------------------------------------------

    def _schedule(self) -> StepPlan:
        waiting_before = len(self.core.scheduler.waiting)
        running_before = self.core.num_running
        plan = self.core.schedule()
        batch = plan.batch
        assert len(batch) <= self.num_slots
        assert [seq.slot for seq in batch] == sorted(seq.slot for seq in batch)  # type: ignore[type-var]
        assert all(seq in batch and not seq.finished for seq in plan.admitted)
        if self.policy is BatchingPolicy.CONTINUOUS:
            # no slot sits empty while a request waits
            assert len(batch) == min(self.num_slots, running_before + waiting_before)
        elif plan.admitted:
            assert running_before == 0 and batch == plan.admitted
        else:
            assert len(batch) == running_before
        return plan

    def _complete(self, plan: StepPlan, tokens: list[int]) -> None:
        steps = len(self.observer.steps)
        self.core.complete(plan, tokens)
        assert len(self.observer.steps) == steps + 1

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
