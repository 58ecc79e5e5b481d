"""Regression tests for what a review of the scheduling policies and the prefix cache found,
each named after the bug (probe scripts reproduced each one before the fix)."""

from __future__ import annotations

from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.policies import PolicyConfig, PolicyName
from app.engine.scheduler import BatchingPolicy, Scheduler, SchedulerConfig
from app.engine.step import ModelOutput, SchedulerOutput
from app.engine.types import RequestStatus, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock_language import MockLanguage

NEVER = -1
LANGUAGE = MockLanguage(text=False, vocab_size=50, stop_token=7, stop_probability=0.0)


def seq(rid: str, prompt: list[int], max_tokens: int, **fields: object) -> Sequence:
    return Sequence(rid, list(prompt), max_tokens, frozenset({NEVER}), **fields)  # type: ignore[arg-type]


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule(0.0)
    sched.update(out, ModelOutput([5] * out.num_outputs), 0.0)
    return out


def run(sched: Scheduler, limit: int = 10_000) -> tuple[int, int]:
    """Steps until idle; returns (steps, preemptions)."""
    steps = preemptions = 0
    while sched.has_work() and steps < limit:
        preemptions += len(step(sched).preempted)
        steps += 1
    return steps, preemptions


def test_fair_does_not_preempt_in_a_storm_when_users_outnumber_slots() -> None:
    config = SchedulerConfig(2, scheduling=PolicyConfig(PolicyName.FAIR))
    sched = Scheduler(config)
    for i in range(6):  # 6 users, 2 slots
        sched.add(seq(f"u{i}", [1] * 50, 40, user=f"user{i}"), 0.0)
    _, preemptions = run(sched)
    # without a margin the counters leapfrogged every token or two: 96 preemptions for 240
    # tokens, each recomputing a context; with the default margin (16 output tokens), at most
    # about one per request's 16-token share
    assert preemptions <= 12


def test_max_overtakes_one_does_not_loop_preempting_and_readmitting_the_victim() -> None:
    policy = PolicyConfig(PolicyName.PRIORITY, max_overtakes=1)
    sched = Scheduler(SchedulerConfig(1, scheduling=policy))
    low = seq("low", [1], 20, priority=9)
    sched.add(low, 0.0)
    step(sched)
    step(sched)  # low has produced tokens: preemptible
    high = seq("high", [2], 3, priority=0)
    sched.add(high, 0.0)
    preempted = []
    for _ in range(40):
        out = step(sched)
        preempted += [s.request_id for s in out.preempted]
        if high.status is RequestStatus.FINISHED:
            break
    # a victim one overtake from the bound is not preempted (it would be readmitted at once,
    # recomputing its context every step while the better request still waits)
    assert preempted.count("low") <= 1
    assert high.status is RequestStatus.FINISHED


def test_a_kv_preemption_under_priority_takes_the_worst_priority_first() -> None:
    policy = PolicyConfig(PolicyName.PRIORITY)
    config = SchedulerConfig(2, block_size=2, kv_cache_tokens=4, scheduling=policy)
    sched = Scheduler(config)
    good, bad = seq("good", [1], 3, priority=0), seq("bad", [1], 3, priority=9)
    sched.add(bad, 0.0)
    sched.add(good, 0.0)  # admitted after bad: the most recent, but the better priority
    step(sched)
    step(sched)
    out = sched.schedule(0.0)  # each needs a second block: only one can have it
    assert [s.request_id for s in out.preempted] == ["bad"]


def test_prefix_cache_metrics_do_not_count_a_preempted_requests_resume() -> None:
    config = SchedulerConfig(1, block_size=2, enable_prefix_caching=True)
    sched = Scheduler(config)
    a = seq("a", [1, 2, 3, 4, 5], 6)
    sched.add(a, 0.0)
    first = step(sched)
    assert (first.prefix_queries, first.prefix_hits) == (5, 0)
    step(sched)
    sched.preempt(a, 0.0)
    resumed = step(sched)
    assert resumed.resumed == [a]
    assert (resumed.prefix_queries, resumed.prefix_hits) == (0, 0)


async def test_static_batching_with_the_prefix_cache_serves_every_request() -> None:
    config = EngineConfig(
        num_slots=3,
        policy=BatchingPolicy.STATIC,
        max_num_batched_tokens=3,
        block_size=2,
        enable_prefix_caching=True,
    )
    engine = Engine(CachedMockModel(3, LANGUAGE), config)
    await engine.start()
    try:
        await engine.submit(seq("warm", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)).collect()
        streams = [engine.submit(seq(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)) for i in range(3)]
        for stream in streams:
            _, reason, error = await stream.collect()
            assert error is None and reason.value == "length"
    finally:
        await engine.stop()
