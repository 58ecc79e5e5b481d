"""The scheduling policies (``--policy``): priority, mlfq, fair, and the bounded bypass they
share, driven through the one ``Scheduler`` step by step, without an event loop.

A step is ``out = schedule(now)`` -> one model call -> ``update(out, ModelOutput, now)``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from reference import run_alone

from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.policies import FairPolicy, MLFQPolicy, PolicyConfig, PolicyName
from app.engine.runner import make_runner
from app.engine.scheduler import BatchingPolicy, Scheduler, SchedulerConfig
from app.engine.step import ModelOutput, SchedulerOutput
from app.engine.types import RequestStatus, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage

STOP = 0
VOCAB = 12
LANGUAGE = MockLanguage(text=False, vocab_size=VOCAB, stop_token=3, stop_probability=0.1)
POLICIES = list(PolicyName)


def seq(
    rid: str, max_tokens: int = 10, prompt_len: int = 2, priority: int = 0, user: str | None = None
) -> Sequence:
    return Sequence(rid, [1] * prompt_len, max_tokens, frozenset({STOP}), priority=priority,
                    user=user)  # fmt: skip


def scheduler(name: PolicyName, num_slots: int = 2, **knobs: object) -> Scheduler:
    config = PolicyConfig(name, **knobs)  # type: ignore[arg-type]
    return Scheduler(SchedulerConfig(num_slots, policy=config))


def step(sched: Scheduler, now: float = 0.0, token: int = 5) -> SchedulerOutput:
    out = sched.schedule(now)
    sched.update(out, ModelOutput([token] * out.num_outputs), now)
    return out


def running(sched: Scheduler) -> list[str]:
    return sorted(s.request_id for s in sched.slots.running())


# --- priority ---------------------------------------------------------------------------------


def test_priority_admits_lower_first_and_fifo_within_a_priority() -> None:
    sched = scheduler(PolicyName.PRIORITY, num_slots=1)
    for s in (seq("a", 1, priority=5), seq("b", 1, priority=-3), seq("c", 1, priority=-3)):
        sched.add(s, 0.0)
    order = [step(sched).admitted[0].request_id for _ in range(3)]
    assert order == ["b", "c", "a"]


def test_priority_preempts_a_running_request_worse_by_the_threshold() -> None:
    sched = scheduler(PolicyName.PRIORITY, num_slots=2, preemption_threshold=2)
    low, mid = seq("low", priority=5), seq("mid", priority=4)
    sched.add(low, 0.0)
    sched.add(mid, 0.0)
    step(sched)
    sched.add(seq("close", priority=3), 0.0)  # better than low by 2, than mid by 1
    out = step(sched)
    assert out.preempted == [low] and low.num_preemptions == 1
    assert low.overtaken == 2  # preempted, then passed over by close (restarted at admission)
    assert running(sched) == ["close", "mid"]
    sched.add(seq("near", priority=3), 0.0)  # only 1 better than mid: waits
    assert step(sched).preempted == []


def test_preemption_delay_lets_a_request_wait_that_long_for_a_free_slot() -> None:
    sched = scheduler(PolicyName.PRIORITY, num_slots=1, preemption_delay=0.5)
    sched.add(seq("low", max_tokens=50, priority=5), 0.0)
    step(sched, now=0.0)
    sched.add(seq("high", priority=0), 1.0)
    assert step(sched, now=1.4).preempted == []
    assert [s.request_id for s in step(sched, now=1.5).preempted] == ["low"]


def test_priority_never_preempts_for_an_equal_priority() -> None:
    sched = scheduler(PolicyName.PRIORITY, num_slots=1)
    sched.add(seq("a"), 0.0)
    step(sched)
    sched.add(seq("b"), 0.0)
    assert step(sched).preempted == [] and running(sched) == ["a"]


# --- mlfq -------------------------------------------------------------------------------------


def test_mlfq_skip_join_puts_a_long_prompt_on_a_lower_level() -> None:
    policy = MLFQPolicy(PolicyConfig(PolicyName.MLFQ, mlfq_skip_join_tokens=4, mlfq_levels=3))
    assert [policy.join_level(n) for n in (1, 4, 5, 8, 9, 100)] == [0, 0, 1, 1, 2, 2]


def test_mlfq_demotes_after_a_quantum_and_preempts_for_a_higher_level() -> None:
    sched = scheduler(PolicyName.MLFQ, num_slots=1, mlfq_quantum=2, mlfq_aging_seconds=0)
    long = seq("long", max_tokens=50)
    sched.add(long, 0.0)
    policy = sched.policy
    assert isinstance(policy, MLFQPolicy)
    step(sched)  # prefill: its first token
    assert policy.level(long) == 0
    sched.add(seq("short", max_tokens=3), 0.0)  # level 0, like long: no preemption
    assert step(sched).preempted == []  # a second token: its level-0 quantum (2) is used
    assert policy.level(long) == 1
    out = step(sched)
    assert out.preempted == [long] and running(sched) == ["short"]
    assert long.level == 1 and long.status is RequestStatus.PREEMPTED


def test_mlfq_aging_lifts_a_waiting_request_one_level_per_period() -> None:
    policy = MLFQPolicy(PolicyConfig(PolicyName.MLFQ, mlfq_aging_seconds=2.0))
    waiting = seq("w")
    waiting.level, waiting.queued_at = 3, 10.0
    assert [policy.waiting_level(waiting, t) for t in (11.9, 12.0, 14.5, 99.0)] == [3, 2, 1, 0]


def test_mlfq_round_robin_at_the_bottom_level() -> None:
    sched = scheduler(PolicyName.MLFQ, num_slots=1, mlfq_levels=1, mlfq_quantum=2,
                      mlfq_aging_seconds=0)  # fmt: skip
    first, second = seq("first", max_tokens=50), seq("second", max_tokens=50)
    sched.add(first, 0.0)
    sched.add(second, 0.0)
    outs = [step(sched) for _ in range(4)]
    assert [s.request_id for o in outs for s in o.preempted] == ["first"]
    assert running(sched) == ["second"] and list(sched.waiting) == [first]


# --- fair -------------------------------------------------------------------------------------


def test_fair_admits_the_user_with_the_smallest_counter() -> None:
    sched = scheduler(PolicyName.FAIR, num_slots=1, fair_preemption=False)
    for i in range(3):
        sched.add(seq(f"heavy{i}", max_tokens=2, user="heavy"), 0.0)
    sched.add(seq("light0", max_tokens=2, user="light"), 0.0)
    admitted = []
    while sched.has_work():
        admitted += [s.request_id for s in step(sched).admitted]
    assert admitted == ["heavy0", "light0", "heavy1", "heavy2"]


def test_fair_preempts_the_heaviest_users_request_for_a_lighter_user() -> None:
    sched = scheduler(PolicyName.FAIR, num_slots=2, fair_preemption_margin=0.0)
    for i in range(4):
        sched.add(seq(f"heavy{i}", max_tokens=50, user="heavy"), 0.0)
    step(sched)
    light = seq("light", max_tokens=2, user="light")
    sched.add(light, 0.0)  # lifted to heavy's counter, which then grows: light is behind
    assert step(sched).preempted == []  # equal counters: no preemption
    out = step(sched)  # heavy has been charged for that step's tokens: light is behind
    assert [s.request_id for s in out.preempted] == ["heavy1"]  # the most recently admitted
    assert out.admitted == [light]


def test_a_policy_never_preempts_a_request_before_its_first_token() -> None:
    long_prompt = seq("long", prompt_len=40)
    sched = Scheduler(SchedulerConfig(1, max_num_batched_tokens=8, policy=PolicyConfig(
        PolicyName.PRIORITY)))  # fmt: skip
    sched.add(long_prompt, 0.0)
    step(sched)  # 8 of its 40 prompt tokens
    sched.add(seq("urgent", priority=-10), 0.0)
    assert all(step(sched).preempted == [] for _ in range(4))  # prefilled by now
    assert step(sched).preempted == [long_prompt]


def test_fair_lifts_a_returning_users_counter_so_idling_earns_no_credit() -> None:
    policy = FairPolicy(PolicyConfig(PolicyName.FAIR))
    busy = seq("b", user="busy")
    policy.on_queued(busy, 0.0, new=True)
    policy.counters["busy"] = 500.0
    idle = seq("i", user="idle")
    policy.on_queued(idle, 0.0, new=True)
    assert policy.counters["idle"] == 500.0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 8)), min_size=30, max_size=60),
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 8)), min_size=30, max_size=60),
    st.integers(1, 4),
)
def test_fair_service_of_two_backlogged_users_differs_by_at_most_the_vtc_bound(
    heavy: list[tuple[int, int]], light: list[tuple[int, int]], num_slots: int
) -> None:
    """Sheng et al., Theorem 4.3: while both are backlogged, two users' weighted service
    differs by at most 2U, U = wp * longest prompt + wq * (tokens the batch can hold)."""
    config = PolicyConfig(PolicyName.FAIR)
    sched = scheduler(PolicyName.FAIR, num_slots=num_slots)
    for user, requests in (("f", heavy), ("g", light)):
        for i, (prompt_len, max_tokens) in enumerate(requests):
            sched.add(seq(f"{user}{i}", max_tokens, prompt_len, user=user), 0.0)
    policy = sched.policy
    assert isinstance(policy, FairPolicy)
    bound = 2 * (config.fair_prompt_weight * 6 + config.fair_output_weight * num_slots * 8)
    while policy.backlog["f"] and policy.backlog["g"]:
        counters = policy.counters
        assert abs(counters["f"] - counters["g"]) <= bound
        step(sched)


# --- the sequential reference, under every policy, with preemptions ---------------------------


@pytest.mark.parametrize("cached", [False, True], ids=["stateless", "cached"])
@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_preempted_and_resumed_requests_produce_the_sequential_references_tokens(
    name: PolicyName, cached: bool, data: st.DataObject
) -> None:
    num_slots = data.draw(st.integers(1, 3), label="slots")
    requests = data.draw(
        st.lists(
            st.tuples(
                st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),  # prompt
                st.integers(0, 30),  # max_tokens
                st.integers(-2, 2),  # priority
                st.sampled_from(["u", "v", None]),  # user
                st.integers(0, 6),  # arrival step
            ),
            min_size=1,
            max_size=8,
        ),
        label="requests",
    )
    model = CachedMockModel(num_slots, LANGUAGE) if cached else MockModel(LANGUAGE)
    config = PolicyConfig(name, max_overtakes=data.draw(st.integers(1, 8)), mlfq_quantum=2,
                          mlfq_skip_join_tokens=4, mlfq_aging_seconds=0.5)  # fmt: skip
    sched = Scheduler(SchedulerConfig(num_slots, max_num_batched_tokens=max(num_slots, 8),
                                      max_prefill_chunk=5, policy=config))  # fmt: skip
    runner = make_runner(model, num_slots)
    seqs = [
        Sequence(f"r{i}", list(p), n, frozenset({LANGUAGE.stop_token}), priority=pr, user=u)
        for i, (p, n, pr, u, _) in enumerate(requests)
    ]
    now = 0.0
    for t in range(10_000):
        for s, request in zip(seqs, requests, strict=True):
            if request[4] == t:
                sched.add(s, now)
        if t > 6 and not sched.has_work():
            break
        out = sched.schedule(now)
        if not out.empty:
            sched.update(out, runner.execute(out), now)
        now += 0.1
    runner.close()
    for s, (prompt, max_tokens, *_) in zip(seqs, requests, strict=True):
        assert s.finished
        assert s.generated == run_alone(MockModel(LANGUAGE), prompt, max_tokens,
                                        LANGUAGE.stop_token, False)  # fmt: skip


# --- bounded bypass: a stateful test ----------------------------------------------------------


class BoundedBypass(RuleBasedStateMachine):
    """Arrivals, steps and aborts in any order, under any policy: no request is ever overtaken
    more than ``max_overtakes`` times, and a request at the bound is the next one admitted."""

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.count = 0
        self.now = 0.0
        self.limit = 1

    @precondition(lambda self: self.sched is None)
    @rule(name=st.sampled_from(POLICIES), slots=st.integers(1, 3), limit=st.integers(1, 6))
    def start(self, name: PolicyName, slots: int, limit: int) -> None:
        self.limit = limit
        config = PolicyConfig(name, max_overtakes=limit, mlfq_quantum=1, mlfq_skip_join_tokens=2,
                              mlfq_aging_seconds=0)  # fmt: skip
        self.sched = Scheduler(SchedulerConfig(slots, policy=config, share_prompts=True))

    @precondition(lambda self: self.sched is not None)
    @rule(
        prompt_len=st.integers(1, 9),
        max_tokens=st.integers(1, 12),
        priority=st.integers(-3, 3),
        user=st.sampled_from(["u", "v", "w"]),
        choices=st.integers(1, 3),
    )
    def arrive(
        self, prompt_len: int, max_tokens: int, priority: int, user: str, choices: int
    ) -> None:
        """A request with ``choices`` choices: those after the first fork from it (waiting,
        not overtaken, while it prefills)."""
        assert self.sched is not None
        first: Sequence | None = None
        for _ in range(choices):
            self.count += 1
            choice = seq(f"r{self.count}", max_tokens, prompt_len, priority, user)
            choice.fork_of = first
            self.sched.add(choice, self.now)
            first = first or choice

    @precondition(lambda self: self.sched is not None)
    @rule(token=st.integers(1, 9))
    def step(self, token: int) -> None:
        sched = self.sched
        assert sched is not None
        starving = [s for s in sched.waiting if s.overtaken >= self.limit]
        out = step(sched, self.now, token)
        self.now += 0.5
        if starving and out.admitted + out.resumed:
            first = min(out.admitted + out.resumed, key=lambda s: s.admission)  # served first
            assert first is starving[0], "a request at the bound was not served next"

    @precondition(lambda self: self.sched is not None and self.count > 0)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        assert self.sched is not None
        self.sched.abort(f"r{data.draw(st.integers(1, self.count))}", self.now)

    @invariant()
    def nobody_is_overtaken_past_the_bound(self) -> None:
        if self.sched is not None:
            seqs = list(self.sched.waiting) + self.sched.slots.running()
            assert all(s.overtaken <= self.limit for s in seqs)


BoundedBypass.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_bounded_bypass = BoundedBypass.TestCase


# --- what a review of the policies and the prefix cache found (each named after its bug) ---


NEVER = -1
NO_STOP = MockLanguage(text=False, vocab_size=50, stop_token=7, stop_probability=0.0)


def never_ending(rid: str, prompt: list[int], max_tokens: int, **fields: object) -> Sequence:
    return Sequence(rid, list(prompt), max_tokens, frozenset({NEVER}), **fields)  # type: ignore[arg-type]


def step_once(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule(0.0)
    sched.update(out, ModelOutput([5] * out.num_outputs), 0.0)
    return out


def run_until_idle(sched: Scheduler, limit: int = 10_000) -> tuple[int, int]:
    """Steps until idle; returns (steps, preemptions)."""
    steps = preemptions = 0
    while sched.has_work() and steps < limit:
        preemptions += len(step_once(sched).preempted)
        steps += 1
    return steps, preemptions


def test_fair_does_not_preempt_in_a_storm_when_users_outnumber_slots() -> None:
    config = SchedulerConfig(2, policy=PolicyConfig(PolicyName.FAIR))
    sched = Scheduler(config)
    for i in range(6):  # 6 users, 2 slots
        sched.add(never_ending(f"u{i}", [1] * 50, 40, user=f"user{i}"), 0.0)
    _, preemptions = run_until_idle(sched)
    # without a margin the counters leapfrogged every token or two: 96 preemptions for 240
    # tokens, each recomputing a context; with the default margin (16 output tokens), at most
    # about one per request's 16-token share
    assert preemptions <= 12


def test_max_overtakes_one_does_not_loop_preempting_and_readmitting_the_victim() -> None:
    policy = PolicyConfig(PolicyName.PRIORITY, max_overtakes=1)
    sched = Scheduler(SchedulerConfig(1, policy=policy))
    low = never_ending("low", [1], 20, priority=9)
    sched.add(low, 0.0)
    step_once(sched)
    step_once(sched)  # low has produced tokens: preemptible
    high = never_ending("high", [2], 3, priority=0)
    sched.add(high, 0.0)
    preempted = []
    for _ in range(40):
        out = step_once(sched)
        preempted += [s.request_id for s in out.preempted]
        if high.status is RequestStatus.FINISHED:
            break
    # a victim one overtake from the bound is not preempted (it would be readmitted at once,
    # recomputing its context every step while the better request still waits)
    assert preempted.count("low") <= 1
    assert high.status is RequestStatus.FINISHED


def test_a_kv_preemption_under_priority_takes_the_worst_priority_first() -> None:
    policy = PolicyConfig(PolicyName.PRIORITY)
    config = SchedulerConfig(2, block_size=2, kv_cache_tokens=4, policy=policy)
    sched = Scheduler(config)
    good, bad = never_ending("good", [1], 3, priority=0), never_ending("bad", [1], 3, priority=9)
    sched.add(bad, 0.0)
    sched.add(good, 0.0)  # admitted after bad: the most recent, but the better priority
    step_once(sched)
    step_once(sched)
    out = sched.schedule(0.0)  # each needs a second block: only one can have it
    assert [s.request_id for s in out.preempted] == ["bad"]


def test_prefix_cache_metrics_do_not_count_a_preempted_requests_resume() -> None:
    config = SchedulerConfig(1, block_size=2, enable_prefix_caching=True)
    sched = Scheduler(config)
    a = never_ending("a", [1, 2, 3, 4, 5], 6)
    sched.add(a, 0.0)
    first = step_once(sched)
    assert (first.prefix_queries, first.prefix_hits) == (5, 0)
    step_once(sched)
    sched.preempt(a, 0.0)
    resumed = step_once(sched)
    assert resumed.resumed == [a]
    assert (resumed.prefix_queries, resumed.prefix_hits) == (0, 0)


async def test_static_batching_with_the_prefix_cache_serves_every_request() -> None:
    config = EngineConfig(
        num_slots=3,
        batching=BatchingPolicy.STATIC,
        max_num_batched_tokens=3,
        block_size=2,
        enable_prefix_caching=True,
    )
    engine = Engine(CachedMockModel(3, NO_STOP), config)
    await engine.start()
    try:
        await engine.submit(never_ending("warm", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)).collect()
        streams = [
            engine.submit(never_ending(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)) for i in range(3)
        ]
        for stream in streams:
            _, reason, error = await stream.collect()
            assert error is None and reason.value == "length"
    finally:
        await engine.stop()
