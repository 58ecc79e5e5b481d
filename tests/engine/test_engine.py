"""The asyncio engine: streaming, aborts, model failures, engine death, back-pressure, drain,
the step clock, chunked prefill and KV preemptions."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from reference import run_alone

import app.engine.engine as engine_module
from app import Request, generate
from app.engine.core import EngineConfig
from app.engine.engine import Engine, Signal
from app.engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
)
from app.engine.scheduler import BatchingPolicy
from app.engine.step import ModelOutput, SchedulerOutput, StepOutcome
from app.engine.step_clock import StepClock, StepCosts, StepWork, sleep_until
from app.engine.stream import Delta, RequestStream
from app.engine.types import FinishReason, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import StepBatch

TEXT_STOP = 256
STOP = 7
TAG = 1000  # prompts start with TAG + index, so a batch entry names its request
NEVER_STOPS = MockLanguage(text=False, vocab_size=50, stop_token=STOP, stop_probability=0.0)
STOPS_OFTEN = MockLanguage(text=False, vocab_size=50, stop_token=STOP, stop_probability=0.1)


def reference(model: Any, prompt: list[int], max_tokens: int, stop: int) -> list[int]:
    """The request run alone (tests/reference.py), stop token left out."""
    return run_alone(model, prompt, max_tokens, stop, include_stop=False)


def seq(rid: str, prompt: list[int], max_tokens: int, stop: int = STOP) -> Sequence:
    return Sequence(rid, list(prompt), max_tokens, frozenset({stop}))


@asynccontextmanager
async def running(model: Any, observer: Any = None, **config: Any) -> AsyncIterator[Engine]:
    engine = Engine(model, EngineConfig(**config), observer)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def deltas_of(stream: RequestStream) -> list[Delta]:
    return [delta async for delta in stream]


def check_deltas(deltas: list[Delta], expected: list[int]) -> FinishReason:
    """Tokens arrive in order, each delta but the last non-empty, the last one with a reason."""
    assert deltas, "a stream ends with at least the delta carrying its finish reason"
    *body, last = deltas
    assert all(d.tokens and d.finish_reason is None for d in body)
    assert last.finish_reason is not None
    assert [t for d in deltas for t in d.tokens] == expected
    return last.finish_reason


class GateModel:
    """Blocks every call until ``gate`` is set; tells the event loop when a call has begun."""

    def __init__(self, inner: Any, fail_after_gate: bool = False) -> None:
        self.inner = inner
        self.loop = asyncio.get_running_loop()
        self.gate = threading.Event()
        self.entered = asyncio.Event()
        self.fail_after_gate = fail_after_gate
        self.heads: list[list[int]] = []

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        self.heads.append([prefix[0] for prefix in batch])
        self.loop.call_soon_threadsafe(self.entered.set)
        if not self.gate.wait(timeout=10):
            raise TimeoutError("the gate never opened")
        if self.fail_after_gate:
            raise RuntimeError("device lost")
        return self.inner.next_tokens(batch)  # type: ignore[no-any-return]


# --- streaming and results ----------------------------------------------------------------


async def test_streams_deliver_tokens_then_a_finish_reason() -> None:
    rng = random.Random(1)
    requests = [
        Request(f"r{i}", list(b"Tell me about " + bytes([97 + i])), rng.randint(1, 60))
        for i in range(10)
    ]
    expected = generate(MockModel(), requests, 3, TEXT_STOP)
    async with running(MockModel(), num_slots=3) as engine:
        streams = [
            engine.submit(seq(r.request_id, r.prompt, r.max_tokens, TEXT_STOP)) for r in requests
        ]
        results = await asyncio.gather(*(deltas_of(s) for s in streams))
    for request, deltas in zip(requests, results, strict=True):
        tokens = expected[request.request_id]
        reason = check_deltas(deltas, tokens)
        short = len(tokens) < request.max_tokens
        assert reason is (FinishReason.STOP if short else FinishReason.LENGTH)
        assert deltas[-1].error is None


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("num_slots", [1, 4])
async def test_outputs_equal_generate(cached: bool, offload: bool, num_slots: int) -> None:
    rng = random.Random(num_slots)
    requests = [
        Request(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(1, 8))], rng.randint(0, 30))
        for i in range(25)
    ]
    expected = generate(MockModel(STOPS_OFTEN), requests, num_slots, STOP)
    model = CachedMockModel(num_slots, STOPS_OFTEN) if cached else MockModel(STOPS_OFTEN)
    async with running(model, num_slots=num_slots, offload_model_calls=offload) as engine:
        streams = [engine.submit(seq(r.request_id, r.prompt, r.max_tokens)) for r in requests]
        results = await asyncio.gather(*(s.collect() for s in streams))
    for request, (tokens, reason, error) in zip(requests, results, strict=True):
        assert tokens == expected[request.request_id]
        assert reason in (FinishReason.STOP, FinishReason.LENGTH) and error is None


async def test_requests_arriving_while_running_get_the_same_results() -> None:
    requests = [Request(f"r{i}", [TAG + i, i], 5 + 3 * i) for i in range(8)]
    ref_model = MockModel(STOPS_OFTEN)
    async with running(MockModel(STOPS_OFTEN), num_slots=2) as engine:
        started = []
        for request in requests:  # each request arrives once the previous one has output
            stream = engine.submit(seq(request.request_id, request.prompt, request.max_tokens))
            started.append((request, await anext(stream), stream))
        for request, first, stream in started:
            deltas = [first, *await deltas_of(stream)]
            expected = reference(ref_model, request.prompt, request.max_tokens, STOP)
            check_deltas(deltas, expected)


async def test_slow_consumer_gets_one_merged_delta() -> None:
    async with running(MockModel(NEVER_STOPS), num_slots=2) as engine:
        stream = engine.submit(seq("a", [1, 2, 3], 40))
        await engine.wait_idle()
        deltas = await deltas_of(stream)
    assert len(deltas) == 1
    assert deltas[0].finish_reason is FinishReason.LENGTH
    assert deltas[0].tokens == reference(MockModel(NEVER_STOPS), [1, 2, 3], 40, STOP)


async def test_max_tokens_zero_ends_at_once_with_no_tokens() -> None:
    async with running(MockModel(), num_slots=1) as engine:
        deltas = await deltas_of(engine.submit(seq("z", [1], 0)))
    assert deltas == [Delta([], FinishReason.LENGTH, None)]


async def test_duplicate_live_id_is_refused_and_reusable_after_the_end() -> None:
    async with running(MockModel(NEVER_STOPS), num_slots=1) as engine:
        stream = engine.submit(seq("a", [1], 3))
        with pytest.raises(DuplicateRequestError):
            engine.submit(seq("a", [2], 3))
        first, _, _ = await stream.collect()
        second, _, _ = await engine.submit(seq("a", [1], 3)).collect()
    assert first == second == reference(MockModel(NEVER_STOPS), [1], 3, STOP)


# --- aborts -----------------------------------------------------------------------------------


async def test_abort_of_a_running_request_frees_its_slot_for_a_waiting_one() -> None:
    ref_model = MockModel(NEVER_STOPS)
    async with running(MockModel(NEVER_STOPS), num_slots=1) as engine:
        long = engine.submit(seq("long", [1, 2], 10**6))
        waiting = engine.submit(seq("next", [3, 4], 5))
        first = await anext(long)
        assert first.tokens and first.finish_reason is None
        assert engine.abort("long") is True
        tokens, reason, error = await long.collect()
        assert reason is FinishReason.ABORT and error is None
        assert 0 < len(tokens) < 10**6
        assert tokens == reference(ref_model, [1, 2], len(tokens), STOP)
        assert await waiting.collect() == (
            reference(ref_model, [3, 4], 5, STOP),
            FinishReason.LENGTH,
            None,
        )
        await engine.wait_idle()
        assert engine.core.scheduler.slots.num_free == 1
        assert engine.abort("long") is False  # already ended


async def test_abort_of_a_waiting_request() -> None:
    model = GateModel(MockModel(NEVER_STOPS))
    async with running(model, num_slots=1) as engine:
        first = engine.submit(seq("first", [TAG], 3))
        queued = engine.submit(seq("queued", [TAG + 1], 3))
        await model.entered.wait()  # "first" is in the model; "queued" waits for its slot
        assert engine.abort("queued") is True
        model.gate.set()
        assert await deltas_of(queued) == [Delta([], FinishReason.ABORT, None)]
        tokens, reason, _ = await first.collect()
    assert reason is FinishReason.LENGTH
    assert tokens == reference(MockModel(NEVER_STOPS), [TAG], 3, STOP)
    assert all(heads == [TAG] for heads in model.heads)  # "queued" never reached the model


async def test_abort_during_a_model_call_drops_that_calls_token_and_refills_the_slot() -> None:
    """The engine applies aborts that arrived during a call before the call's tokens: the
    aborted request gets nothing from that call, and its slot goes to the waiting request in
    the very next call."""
    model = GateModel(MockModel(NEVER_STOPS))
    async with running(model, num_slots=1) as engine:
        first = engine.submit(seq("first", [TAG], 5))
        queued = engine.submit(seq("queued", [TAG + 1], 2))
        await model.entered.wait()  # the first call, with "first" alone, is running
        engine.abort("first")
        model.gate.set()
        assert await first.collect() == ([], FinishReason.ABORT, None)
        assert (await queued.collect())[1] is FinishReason.LENGTH
    assert model.heads[:2] == [[TAG], [TAG + 1]]


async def test_a_cancelled_request_stops_counting_against_the_queue_bound_at_once() -> None:
    """Found in review: a request cancelled during a model call kept its place in the queue
    bound until the call ended, so a client that cancelled and resubmitted got a 429."""
    model = GateModel(MockModel(NEVER_STOPS))
    async with running(model, num_slots=1, max_waiting=0) as engine:
        first = engine.submit(seq("first", [TAG], 50))
        await model.entered.wait()
        with pytest.raises(QueueFullError):
            engine.submit(seq("second", [TAG + 1], 2))
        assert engine.abort("first") and engine.abort("first")  # twice: one abort queued
        second = engine.submit(seq("second", [TAG + 1], 2))
        engine.abort("second")
        with pytest.raises(QueueFullError):  # but at most another bound's worth of aborts
            engine.submit(seq("third", [TAG + 2], 2))
        model.gate.set()
        assert await first.collect() == ([], FinishReason.ABORT, None)
        assert await second.collect() == ([], FinishReason.ABORT, None)
        await engine.wait_idle()
        assert not engine.core.aborting


async def test_abort_of_an_unknown_request_is_refused() -> None:
    async with running(MockModel(), num_slots=1) as engine:
        assert engine.abort("nobody") is False


# --- model failures ---------------------------------------------------------------------------


class FailOnCall:
    def __init__(self, inner: Any, fail_on: int) -> None:
        self.inner, self.fail_on = inner, fail_on
        self.calls = 0
        self.batches: list[list[int]] = []
        self.error = KeyError("device lost")

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        self.batches.append([prefix[0] - TAG for prefix in batch])
        self.calls += 1
        if self.calls - 1 == self.fail_on:
            raise self.error
        return self.inner.next_tokens(batch)  # type: ignore[no-any-return]


@pytest.mark.parametrize("fail_on", [0, 2, 5])
async def test_a_failing_model_call_ends_exactly_its_batch(fail_on: int) -> None:
    model = FailOnCall(MockModel(NEVER_STOPS), fail_on)
    ref_model = MockModel(NEVER_STOPS)
    max_tokens = [2, 4, 6, 3, 5, 8]
    async with running(model, num_slots=3) as engine:
        streams = [engine.submit(seq(f"r{i}", [TAG + i], m)) for i, m in enumerate(max_tokens)]
        results = await asyncio.gather(*(s.collect() for s in streams))
        failed = set(model.batches[fail_on])
        for i, (tokens, reason, error) in enumerate(results):
            expected = reference(ref_model, [TAG + i], max_tokens[i], STOP)
            if i in failed:
                assert reason is FinishReason.ERROR and error is model.error
                assert tokens == expected[: len(tokens)] and len(tokens) < max_tokens[i]
            else:
                assert (tokens, reason, error) == (expected, FinishReason.LENGTH, None)
        # the engine keeps serving
        assert engine.alive
        later = await engine.submit(seq("later", [TAG + 9], 4)).collect()
        assert later == (reference(ref_model, [TAG + 9], 4, STOP), FinishReason.LENGTH, None)


async def test_broken_output_is_reported_as_a_model_error() -> None:
    class WrongCount:
        def next_tokens(self, batch: list[list[int]]) -> list[int]:
            return [1] * (len(batch) + 1)

    async with running(WrongCount(), num_slots=2) as engine:
        tokens, reason, error = await engine.submit(seq("a", [1], 3)).collect()
        assert tokens == [] and reason is FinishReason.ERROR
        assert error is not None and "expected 1" in str(error)
        assert engine.alive


async def test_cached_engine_recovers_from_a_failed_prefill() -> None:
    """A prefill that raises must cost only that step's requests, not every later one."""

    class BadPrompt(CachedMockModel):
        def step(self, batch: StepBatch) -> list[int]:
            if any(chunk.token_ids == [666] for chunk in batch.prefills):
                raise RuntimeError("prompt too long")
            return super().step(batch)

    ref_model = MockModel(NEVER_STOPS)
    async with running(BadPrompt(2, NEVER_STOPS), num_slots=2) as engine:
        _, reason, _ = await engine.submit(seq("bad", [666], 5)).collect()
        assert reason is FinishReason.ERROR
        for i in range(4):
            result = await engine.submit(seq(f"ok{i}", [i + 1], 5)).collect()
            assert result == (reference(ref_model, [i + 1], 5, STOP), FinishReason.LENGTH, None)


async def test_cached_engine_slot_reuse_after_an_idle_gap() -> None:
    """A slot released while the engine goes idle is reset before it is reused."""
    ref_model = MockModel(NEVER_STOPS)
    async with running(CachedMockModel(1, NEVER_STOPS), num_slots=1) as engine:
        for rid, max_tokens in [("a", 4), ("z", 0), ("b", 4), ("c", 1)]:
            result = await engine.submit(seq(rid, [len(rid), 9], max_tokens)).collect()
            expected = reference(ref_model, [len(rid), 9], max_tokens, STOP)
            assert result == (expected, FinishReason.LENGTH, None)
            await engine.wait_idle()


# --- engine death -----------------------------------------------------------------------------


async def test_engine_death_ends_every_stream_and_refuses_new_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine(MockModel(NEVER_STOPS), EngineConfig(num_slots=2))
    crash = RuntimeError("bookkeeping bug")

    def update(out: SchedulerOutput, result: ModelOutput) -> None:
        raise crash

    monkeypatch.setattr(engine.core, "update", update)
    await engine.start()
    streams = [engine.submit(seq(f"r{i}", [i], 50)) for i in range(3)]  # 2 running, 1 waiting
    for stream in streams:
        tokens, reason, error = await asyncio.wait_for(stream.collect(), timeout=5)
        assert reason is FinishReason.ERROR and tokens == []  # no step was ever completed
        assert isinstance(error, EngineDeadError)
    assert not engine.alive
    assert engine.death is crash
    assert not engine.core.live
    with pytest.raises(EngineDeadError):
        engine.submit(seq("late", [1], 5))
    await engine.stop()  # still safe to call


async def test_submit_before_start_is_refused() -> None:
    engine = Engine(MockModel(), EngineConfig(num_slots=1))
    with pytest.raises(EngineDeadError):
        engine.submit(seq("a", [1], 1))


# --- back-pressure ----------------------------------------------------------------------------


async def test_queue_full_is_refused_until_requests_leave() -> None:
    """``max_waiting`` requests may wait beyond the ones that fill the slots."""
    async with running(MockModel(NEVER_STOPS), num_slots=2, max_waiting=1) as engine:
        accepted = [engine.submit(seq(f"r{i}", [i], 3)) for i in range(3)]
        with pytest.raises(QueueFullError):
            engine.submit(seq("r3", [3], 3))
        assert "r3" not in engine.core.live
        for stream in accepted:
            assert (await stream.collect())[1] is FinishReason.LENGTH
        assert (await engine.submit(seq("r3", [3], 3)).collect())[1] is FinishReason.LENGTH


# --- stop / drain -----------------------------------------------------------------------------


async def test_stop_lets_running_requests_finish_within_grace() -> None:
    model = GateModel(MockModel(NEVER_STOPS))
    engine = Engine(model, EngineConfig(num_slots=1))
    await engine.start()
    running_stream = engine.submit(seq("running", [TAG], 4))
    waiting_stream = engine.submit(seq("waiting", [TAG + 1], 4))
    await model.entered.wait()
    stop = asyncio.create_task(engine.stop(grace=10))
    await asyncio.sleep(0)  # let stop() run up to its first await: it is now draining
    with pytest.raises(EngineDrainingError):
        engine.submit(seq("new", [TAG + 2], 4))
    model.gate.set()
    await stop
    assert await running_stream.collect() == (
        reference(MockModel(NEVER_STOPS), [TAG], 4, STOP),
        FinishReason.LENGTH,
        None,
    )
    assert await waiting_stream.collect() == ([], FinishReason.ABORT, None)
    assert not engine.alive
    assert all(heads == [TAG] for heads in model.heads)


async def test_stop_aborts_what_is_still_running_after_grace() -> None:
    engine = Engine(MockModel(NEVER_STOPS), EngineConfig(num_slots=1))
    await engine.start()
    long = engine.submit(seq("long", [1], 10**7))
    queued = engine.submit(seq("queued", [2], 5))
    await anext(long)  # it is running
    # it returns once the aborts are applied, never waiting out the stuck-call timeout
    await asyncio.wait_for(engine.stop(grace=0.05, call_timeout=60), timeout=30)
    tokens, reason, _ = await long.collect()
    assert reason is FinishReason.ABORT
    assert tokens == reference(MockModel(NEVER_STOPS), [1], len(tokens), STOP)
    assert await queued.collect() == ([], FinishReason.ABORT, None)


async def test_an_idle_engine_leaves_no_cache_in_use() -> None:
    """Found in review: releases reached a cached model only with the next model call, so an
    idle replica kept reporting KV-cache usage (``vllm:kv_cache_usage_perc``) to gateways."""
    model = CachedMockModel(4, NEVER_STOPS)
    async with running(model, num_slots=4) as engine:
        streams = [engine.submit(seq(f"r{i}", [TAG + i], 2 + i)) for i in range(3)]
        for stream in streams:
            await stream.collect()
        await engine.wait_idle()
        assert model.held_slots() == []
        assert (await engine.submit(seq("again", [TAG], 3)).collect())[1] is FinishReason.LENGTH


async def test_stop_releases_every_slot_of_a_cached_model() -> None:
    model = CachedMockModel(2, NEVER_STOPS)
    engine = Engine(model, EngineConfig(num_slots=2))
    await engine.start()
    streams = [engine.submit(seq(f"r{i}", [TAG + i], 3)) for i in range(3)]
    for stream in streams:
        await stream.collect()
    await engine.stop()
    assert model.held_slots() == []


class BlockingCachedModel(CachedMockModel):
    """A cached mock whose ``step`` waits for ``gate`` and which records every release with
    whether a step was running at the time; ``release`` raises when ``fail_release``."""

    blocking = True  # its calls wait: the engine runs them in its worker thread

    def __init__(self, fail_release: bool = False) -> None:
        super().__init__(1, NEVER_STOPS)
        self.loop = asyncio.get_running_loop()
        self.gate = threading.Event()
        self.entered = asyncio.Event()
        self.decoding = False
        self.fail_release = fail_release
        self.releases: list[tuple[int, bool]] = []

    def step(self, batch: StepBatch) -> list[int]:
        self.decoding = True
        self.loop.call_soon_threadsafe(self.entered.set)
        try:
            self.gate.wait(timeout=10)
            return super().step(batch)
        finally:
            self.decoding = False

    def release(self, slot: int) -> None:
        self.releases.append((slot, self.decoding))
        if self.fail_release:
            raise RuntimeError("release failed")
        super().release(slot)


async def test_stopping_twice_never_releases_a_slot_under_an_abandoned_call() -> None:
    """Found in review: SIGTERM stops the engine twice (the drain, then the lifespan). When the
    first stop abandoned a stuck call, the second released the slot that call was decoding."""
    model = BlockingCachedModel()
    engine = Engine(model, EngineConfig(num_slots=1))
    await engine.start()
    stream = engine.submit(seq("a", [TAG], 5))
    await model.entered.wait()
    try:
        await engine.stop(grace=0, call_timeout=0.05)
        await engine.stop()
        assert (await stream.collect())[1] is FinishReason.ABORT
        assert model.releases == []
    finally:
        model.gate.set()


async def test_a_model_that_fails_to_release_does_not_break_stop() -> None:
    model = BlockingCachedModel(fail_release=True)
    model.gate.set()
    engine = Engine(model, EngineConfig(num_slots=1))
    await engine.start()
    stream = engine.submit(seq("a", [TAG], 10**6))
    await anext(stream)
    await engine.stop()
    assert (await stream.collect())[1] is FinishReason.ABORT and not engine.alive


async def test_stop_returns_promptly_when_the_last_call_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = GateModel(MockModel(NEVER_STOPS), fail_after_gate=True)
    engine = Engine(model, EngineConfig(num_slots=1))
    await engine.start()
    stream = engine.submit(seq("a", [1], 5))
    await model.entered.wait()
    put = engine._inbox.put_nowait

    def put_then_fail_the_call(message: Any) -> None:  # the call fails once stop() has asked
        put(message)
        if message is Signal.SHUTDOWN:
            model.gate.set()

    monkeypatch.setattr(engine._inbox, "put_nowait", put_then_fail_the_call)
    # not the stuck-call wait for a task that never ends
    await asyncio.wait_for(engine.stop(grace=0, call_timeout=60), timeout=30)
    _, reason, _ = await stream.collect()
    assert reason in (FinishReason.ABORT, FinishReason.ERROR)


async def test_stop_does_not_hang_on_a_model_call_that_never_returns() -> None:
    model = GateModel(MockModel(NEVER_STOPS))
    engine = Engine(model, EngineConfig(num_slots=1))
    await engine.start()
    stream = engine.submit(seq("a", [1], 5))
    await model.entered.wait()
    queued = engine.submit(seq("b", [2], 5))  # still in the inbox: the engine is stuck
    try:
        await asyncio.wait_for(engine.stop(grace=0, call_timeout=0.05), timeout=5)
        assert await asyncio.wait_for(stream.collect(), 1) == ([], FinishReason.ABORT, None)
        assert await asyncio.wait_for(queued.collect(), 1) == ([], FinishReason.ABORT, None)
        assert not engine.alive and not engine.core.live
    finally:
        model.gate.set()  # let the worker thread finish


# --- threading, policy -----------------------------------------------------------------------


async def test_model_calls_run_off_the_event_loop() -> None:
    loop = asyncio.get_running_loop()
    loop_thread = threading.current_thread()

    class Handshake:
        """Waits for the event loop to answer: a model call on the loop thread would deadlock
        (and time out)."""

        def __init__(self) -> None:
            self.answered = threading.Event()
            self.asked = asyncio.Event()
            self.threads: list[threading.Thread] = []

        def next_tokens(self, batch: list[list[int]]) -> list[int]:
            self.threads.append(threading.current_thread())
            loop.call_soon_threadsafe(self.asked.set)
            if not self.answered.wait(timeout=5):
                raise TimeoutError("the event loop could not run during the model call")
            return [1] * len(batch)

    model = Handshake()
    async with running(model, num_slots=1) as engine:
        stream = engine.submit(seq("a", [2], 3))
        await model.asked.wait()
        model.answered.set()
        assert await stream.collect() == ([1, 1, 1], FinishReason.LENGTH, None)
    assert model.threads and all(t is not loop_thread for t in model.threads)


@pytest.mark.parametrize("policy", [BatchingPolicy.STATIC, BatchingPolicy.CONTINUOUS])
async def test_static_policy_admits_only_into_an_empty_batch(policy: BatchingPolicy) -> None:
    model = FailOnCall(MockModel(NEVER_STOPS), fail_on=-1)
    async with running(model, num_slots=2, batching=policy) as engine:
        streams = [engine.submit(seq(f"r{i}", [TAG + i], m)) for i, m in enumerate([6, 2, 2])]
        for stream in streams:
            assert (await stream.collect())[1] is FinishReason.LENGTH
    calls_with = {i: [k for k, b in enumerate(model.batches) if i in b] for i in range(3)}
    if policy is BatchingPolicy.STATIC:
        # r2 waits for the whole first batch (r0 and r1) to end although a slot freed early
        assert calls_with[2][0] > calls_with[0][-1]
        assert len(model.batches) == 6 + 2
    else:
        assert calls_with[2][0] == calls_with[1][-1] + 1  # takes r1's slot at once
        assert len(model.batches) == 6


# --- observer ---------------------------------------------------------------------------------


async def test_observer_sees_every_step_and_every_end_once() -> None:
    class Observer:
        def __init__(self) -> None:
            self.steps = 0
            self.finished: list[str] = []

        def on_step(self, outcome: StepOutcome) -> None:
            self.steps += 1
            assert outcome.ended_at >= outcome.output.started_at and outcome.error is None

        def on_finished(self, seq: Sequence) -> None:
            self.finished.append(seq.request_id)

    observer = Observer()
    model = FailOnCall(MockModel(NEVER_STOPS), fail_on=-1)
    async with running(model, observer, num_slots=2) as engine:
        streams = [engine.submit(seq(f"r{i}", [TAG + i], i)) for i in range(5)]
        await asyncio.gather(*(s.collect() for s in streams))
    assert sorted(observer.finished) == [f"r{i}" for i in range(5)]
    assert observer.steps == len(model.batches)


async def test_inline_model_calls_still_let_the_event_loop_run_between_steps() -> None:
    """With ``offload_model_calls=False`` the model runs on the loop, but a long request must
    still stream and be abortable rather than hold the loop until it ends."""
    async with running(MockModel(NEVER_STOPS), num_slots=1, offload_model_calls=False) as engine:
        long = engine.submit(seq("long", [1], 10**6))
        first = await anext(long)
        assert first.finish_reason is None
        assert engine.abort("long")
        tokens, reason, _ = await long.collect()
        assert reason is FinishReason.ABORT and len(tokens) < 100


# --- the step clock ---------------------------------------------------------------------------


def test_step_clock_mean_and_enabled() -> None:
    assert not StepCosts().enabled
    assert StepClock(StepCosts()).duration(StepWork.counts(100, 8)) == 0.0
    costs = StepCosts(step_ms=10, prefill_token_ms=0.5, decode_token_ms=2)
    assert costs.enabled
    assert StepClock(costs).duration(StepWork.counts(20, 4)) == pytest.approx((10 + 10 + 8) / 1000)
    assert StepClock(costs).deadline(5.0, StepWork.counts(0, 1)) == pytest.approx(5.012)


@pytest.mark.parametrize("jitter", [0.1, 0.3, 1.0, 50.0])
def test_step_clock_jitter_is_capped_at_30_percent(jitter: float) -> None:
    clock = StepClock(StepCosts(step_ms=100), seed=7, jitter=jitter)
    samples = [clock.duration(StepWork.counts(0, 1)) for _ in range(3_000)]
    assert min(samples) >= 0.1 * 0.7 - 1e-12  # the documented +-30%
    assert max(samples) <= 0.1 * 1.3 + 1e-12
    assert sum(samples) / len(samples) == pytest.approx(0.1, rel=0.05)
    assert max(samples) > min(samples)  # it does jitter
    again = StepClock(StepCosts(step_ms=100), seed=7, jitter=jitter)
    assert [
        again.duration(StepWork.counts(0, 1)) for _ in range(3_000)
    ] == samples  # seeded: reproducible


class FakeTime:
    """A clock the test moves: the model's call takes ``call_seconds`` of it, and the engine's
    waits for a step's deadline (recorded) take what they ask."""

    def __init__(self, call_seconds: float) -> None:
        self.now = 100.0
        self.call_seconds = call_seconds
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep_until(self, deadline: float, clock: Callable[[], float]) -> None:
        assert clock is self
        self.waits.append(max(0.0, deadline - self.now))
        self.now = max(self.now, deadline)
        await asyncio.sleep(0)


class StepRecorder:
    """An observer keeping every step's outcome summary."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int, int]] = []  # started, ended, prefill, decode
        self.outcomes: list[StepOutcome] = []

    def on_step(self, outcome: StepOutcome) -> None:
        out = outcome.output
        self.outcomes.append(outcome)
        self.steps.append(
            (out.started_at, outcome.ended_at, out.num_prefill_tokens, out.num_decode_tokens)
        )

    def on_finished(self, seq: Sequence) -> None:
        pass


@pytest.mark.parametrize("call_ms", [0.0, 30.0, 200.0])
async def test_a_step_lasts_its_cost_from_the_steps_start(
    call_ms: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of ``b0 + b1 * prefill + b2 * decode`` ms ends that long after it was scheduled:
    the engine sleeps only for what the model call left of it (nothing once the call took
    longer), on the event loop."""
    fake = FakeTime(call_ms / 1000)

    class TimedModel(MockModel):
        def next_tokens(self, batch: list[list[int]]) -> list[int]:
            fake.now += fake.call_seconds
            return super().next_tokens(batch)

    costs = StepCosts(step_ms=50, prefill_token_ms=1, decode_token_ms=2)
    recorder = StepRecorder()
    engine = Engine(TimedModel(NEVER_STOPS), EngineConfig(num_slots=2, step_costs=costs), recorder)
    engine.core.clock = fake
    monkeypatch.setattr(engine_module, "sleep_until", fake.sleep_until)
    await engine.start()
    try:
        a = engine.submit(seq("a", [1, 2, 3], 3))
        b = engine.submit(seq("b", [4], 2))
        await asyncio.gather(a.collect(), b.collect())
    finally:
        await engine.stop()
    assert [(p, d) for _, _, p, d in recorder.steps] == [(4, 0), (0, 2), (0, 1)]
    expected = [max(0.0, (50 + p + 2 * d - call_ms) / 1000) for _, _, p, d in recorder.steps]
    assert fake.waits == pytest.approx(expected)
    for started, ended, p, d in recorder.steps:
        assert ended - started == pytest.approx(max(50 + p + 2 * d, call_ms) / 1000)


async def test_sleep_until_returns_at_the_deadline_not_before() -> None:
    for delay in (0.0, 0.0005, 0.003, 0.02):
        deadline = time.monotonic() + delay
        await sleep_until(deadline)
        assert time.monotonic() >= deadline
    await sleep_until(time.monotonic() - 1.0)  # a deadline already past: no wait


async def test_steps_take_at_least_their_cost_in_real_time() -> None:
    """The steps together never run faster than their costs add up to. A single step may be
    shorter than its cost when the one before it ended late (the pacing catches up, so the mean
    inter-token latency stays right: the documented trade-off), so a loaded machine cannot make
    this fail; only a clock that runs fast can."""
    costs = StepCosts(step_ms=4, prefill_token_ms=0.5, decode_token_ms=1)
    recorder = StepRecorder()
    async with running(MockModel(NEVER_STOPS), recorder, num_slots=3, step_costs=costs) as engine:
        streams = [engine.submit(seq(f"r{i}", [TAG + i] * (1 + 4 * i), 4)) for i in range(3)]
        await asyncio.gather(*(s.collect() for s in streams))
    assert recorder.steps
    first_start, last_end = recorder.steps[0][0], recorder.steps[-1][1]
    total_cost = sum((4 + 0.5 * p + d) / 1000 for _, _, p, d in recorder.steps)
    assert last_end - first_start >= total_cost - 1e-3


async def test_step_costs_do_not_change_outputs() -> None:
    requests = [Request(f"r{i}", [TAG + i, i], 6 + i) for i in range(5)]
    expected = generate(MockModel(STOPS_OFTEN), requests, 2, STOP)
    costs = StepCosts(decode_token_ms=0.05, prefill_token_ms=0.01)
    async with running(
        MockModel(STOPS_OFTEN), num_slots=2, step_costs=costs, step_jitter=0.2
    ) as engine:
        streams = [engine.submit(seq(r.request_id, r.prompt, r.max_tokens)) for r in requests]
        results = await asyncio.gather(*(s.collect() for s in streams))
    assert {r.request_id: tokens for r, (tokens, _, _) in zip(requests, results, strict=True)} == (
        expected
    )


# --- chunked prefill and KV preemptions -------------------------------------------------------


@pytest.mark.parametrize("cached", [True, False])
async def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_decoding(
    cached: bool,
) -> None:
    """One 6,000-token prompt arriving among 4 decoding requests with a budget of 512 tokens per
    step is prefilled over 12 steps (508 prompt tokens each, 412 in the last), and the 4 get one
    token in every one of those steps: the long prompt never stalls them."""
    recorder = StepRecorder()
    model = CachedMockModel(5, NEVER_STOPS) if cached else MockModel(NEVER_STOPS)
    async with running(model, recorder, num_slots=5, max_num_batched_tokens=512) as engine:
        decoders = [engine.submit(seq(f"d{i}", [TAG + i, 1, 2], 10**6)) for i in range(4)]
        for stream in decoders:
            await anext(stream)  # all 4 are decoding
        prompt = [random.Random(0).randrange(50) for _ in range(6_000)]
        long = engine.submit(seq("long", prompt, 3))
        assert await long.collect() == (
            reference(MockModel(NEVER_STOPS), prompt, 3, STOP),
            FinishReason.LENGTH,
            None,
        )
        for stream in decoders:
            engine.abort(stream.request_id)
        await asyncio.gather(*(s.collect() for s in decoders))
    first = next(i for i, o in enumerate(recorder.outcomes) if o.output.admitted)
    assert [s.request_id for s in recorder.outcomes[first].output.admitted] == [
        "d0",
        "d1",
        "d2",
        "d3",
    ]
    start = next(
        i
        for i, o in enumerate(recorder.outcomes)
        if any(s.request_id == "long" for s in o.output.admitted)
    )
    window = recorder.outcomes[start : start + 13]
    assert [(o.output.num_prefill_tokens, o.output.num_decode_tokens) for o in window] == [
        *[(508, 4)] * 11,
        (412, 4),
        (0, 5),  # the long request decodes with the others
    ]
    assert all(o.num_decode_generated == 4 for o in window[:12])  # the 4 got a token each step
    assert [o.output.prefills[0].sample for o in window[:12]] == [False] * 11 + [True]
    assert all(max(len(c.token_ids) for c in o.output.prefills) <= 512 for o in window[:12])


@pytest.mark.parametrize("cached", [True, False])
async def test_kv_preemptions_are_invisible_to_streams(cached: bool) -> None:
    """A KV cache too small for every running request preempts the most recently admitted
    ones; each resumes where it stopped, so every stream gets exactly the reference's tokens,
    none twice and none missing."""
    rng = random.Random(3)
    requests = [
        Request(f"r{i}", [TAG + i, *(rng.randrange(50) for _ in range(rng.randint(0, 7)))], 30)
        for i in range(8)
    ]
    recorder = StepRecorder()
    model = CachedMockModel(3, NEVER_STOPS) if cached else MockModel(NEVER_STOPS)
    config: dict[str, Any] = {"num_slots": 3, "block_size": 4, "kv_cache_tokens": 40}
    async with running(model, recorder, **config) as engine:
        streams = [engine.submit(seq(r.request_id, r.prompt, r.max_tokens)) for r in requests]
        results = await asyncio.gather(*(deltas_of(s) for s in streams))
        scheduler = engine.core.scheduler
        assert scheduler.books.used(scheduler.slots.running()) == 0
    for request, deltas in zip(requests, results, strict=True):
        expected = reference(MockModel(NEVER_STOPS), request.prompt, request.max_tokens, STOP)
        assert check_deltas(deltas, expected) is FinishReason.LENGTH
    preempted = [s for o in recorder.outcomes for s in o.output.preempted]
    assert preempted  # the cache was small enough to preempt
    resumed = [s for o in recorder.outcomes for s in o.output.resumed]
    assert sorted(s.request_id for s in resumed) == sorted(s.request_id for s in preempted)
    admitted = [s.request_id for o in recorder.outcomes for s in o.output.admitted]
    assert sorted(admitted) == sorted(r.request_id for r in requests)  # each admitted once
    if cached:
        assert model.held_slots() == []  # type: ignore[union-attr]
