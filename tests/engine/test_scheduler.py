"""Unit tests of the one slot logic: Scheduler, SlotTable and WaitingQueue.

A step is ``out = schedule(now)`` -> the model's tokens -> ``update(out, ModelOutput, now)``.
A short prompt is prefilled in the step that admits it (that step samples its first token);
from the next step on it decodes one token per step.
"""

from __future__ import annotations

import pytest

from app.engine.scheduler import BatchingPolicy, Scheduler, SchedulerConfig
from app.engine.slots import SlotTable
from app.engine.step import ModelOutput, SchedulerOutput, StepOutcome
from app.engine.types import FinishReason, RequestStatus, Sequence
from app.engine.waiting import WaitingQueue
from app.models.protocol import NO_TOKEN, SamplingParams

STOP = 0


def seq(rid: str, max_tokens: int = 10, prompt: list[int] | None = None) -> Sequence:
    return Sequence(rid, list(prompt or [1, 2]), max_tokens, frozenset({STOP}))


def status(s: Sequence) -> RequestStatus:
    """``s.status`` (a call, so mypy does not narrow it across a scheduler call)."""
    return s.status


def used(scheduler: Scheduler) -> int:
    """KV blocks held by the running requests."""
    return scheduler.books.used(scheduler.slots.running())


def blocks(scheduler: Scheduler, s: Sequence) -> int:
    """KV blocks ``s`` holds: its computed tokens in whole blocks (0 unless running)."""
    return scheduler.books.blocks_for(s.num_computed_tokens)


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def scheduler_with(
    *seqs: Sequence, num_slots: int = 2, batching: BatchingPolicy = BatchingPolicy.CONTINUOUS
) -> Scheduler:
    return configured(SchedulerConfig(num_slots, batching), *seqs)


def configured(config: SchedulerConfig, *seqs: Sequence) -> Scheduler:
    scheduler = Scheduler(config)
    for s in seqs:
        scheduler.add(s, 0.0)
    return scheduler


def answer(
    scheduler: Scheduler, out: SchedulerOutput, token: int = 5, now: float = 0.0
) -> StepOutcome:
    """The model answers ``token`` for every output ``out`` asks for."""
    return scheduler.update(out, ModelOutput([token] * out.num_outputs), now)


def step(scheduler: Scheduler, token: int = 5, now: float = 0.0) -> SchedulerOutput:
    out = scheduler.schedule(now)
    answer(scheduler, out, token, now)
    return out


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request, start, length, sample) of every prefill chunk."""
    return [
        (s.request_id, c.start, len(c.token_ids), c.sample)
        for s, c in zip(out.prefill_seqs, out.prefills, strict=True)
    ]


# --- admission --------------------------------------------------------------------------------


def test_admits_in_arrival_order_up_to_the_slot_count() -> None:
    a, b, c = seq("a"), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c)
    out = scheduler.schedule(1.0)
    assert ids(out.prefill_seqs) == ["a", "b"] and out.decode_seqs == []
    assert ids(out.admitted) == ["a", "b"] and out.resumed == []
    assert (a.slot, b.slot, c.slot) == (0, 1, None)
    assert (a.status, c.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    assert "c" in scheduler.waiting
    assert a.times.admitted == 1.0 and c.times.admitted is None
    # a short prompt is prefilled whole in one fresh chunk that samples
    assert chunks(out) == [("a", 0, 2, True), ("b", 0, 2, True)]
    assert [c.slot for c in out.prefills] == [0, 1] and all(c.fresh for c in out.prefills)
    assert out.num_prefill_tokens == 4 and out.num_decode_tokens == 0 and out.num_outputs == 2


def test_after_its_prefill_a_request_decodes_its_last_token_every_step() -> None:
    a = seq("a", prompt=[1, 2, 3])
    scheduler = scheduler_with(a)
    answer(scheduler, scheduler.schedule(0.0), token=7)
    assert a.generated == [7] and a.num_computed_tokens == 3 and not a.prefilling
    out = scheduler.schedule(0.0)
    assert out.decode_seqs == [a] and out.decode_tokens == [7] and out.prefills == []
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)
    answer(scheduler, out, token=8)
    assert a.generated == [7, 8] and a.num_computed_tokens == 4


def test_max_tokens_zero_finishes_at_once_and_never_runs() -> None:
    z = seq("z", max_tokens=0)
    scheduler = Scheduler(2)
    assert scheduler.add(z, 0.0) is True
    assert z.finish_reason is FinishReason.LENGTH and z.generated == []
    assert z.status is RequestStatus.FINISHED
    assert not scheduler.has_work()
    assert scheduler.schedule(0.0).empty


def test_slot_freed_by_a_finish_is_refilled_in_the_same_schedule() -> None:
    a, b, c = seq("a", max_tokens=1), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c)
    out = scheduler.schedule(0.0)
    outcome = answer(scheduler, out)
    assert outcome.finished == [a] and outcome.num_generated == 2
    assert a.finish_reason is FinishReason.LENGTH and a.slot is None
    assert a.status is RequestStatus.FINISHED
    out = scheduler.schedule(0.0)
    assert out.decode_seqs == [b] and out.prefill_seqs == [c]  # c took a's slot 0
    assert out.admitted == [c] and out.released == [0]
    assert c.slot == 0


def test_stop_token_finishes_and_is_kept_only_with_include_stop() -> None:
    a, b = seq("a"), seq("b")
    b.include_stop = True
    scheduler = scheduler_with(a, b)
    step(scheduler, token=STOP)
    assert (a.finish_reason, b.finish_reason) == (FinishReason.STOP, FinishReason.STOP)
    assert a.generated == [] and b.generated == [STOP]
    assert scheduler.slots.occupied == 0 and used(scheduler) == 0


def test_any_of_several_stop_tokens_finishes() -> None:
    a = Sequence("a", [1], 10, frozenset({3, 4}))
    scheduler = scheduler_with(a)
    step(scheduler, token=5)
    step(scheduler, token=4)  # a decode step this time
    assert a.finish_reason is FinishReason.STOP and a.generated == [5]


def test_update_needs_one_token_per_output() -> None:
    scheduler = scheduler_with(seq("a"), seq("b"))
    out = scheduler.schedule(0.0)
    with pytest.raises(ValueError):
        scheduler.update(out, ModelOutput([1]), 0.0)


def test_first_token_time_is_recorded_once() -> None:
    a = seq("a")
    scheduler = scheduler_with(a)
    answer(scheduler, scheduler.schedule(1.0), now=2.0)
    answer(scheduler, scheduler.schedule(3.0), now=4.0)
    assert a.times.first_token == 2.0


def test_lowest_free_slot_is_used_first() -> None:
    a, b, c = seq("a", max_tokens=1), seq("b"), seq("c", max_tokens=1)
    d, e = seq("d"), seq("e")
    scheduler = scheduler_with(a, b, c, num_slots=3)
    step(scheduler)  # a (slot 0) and c (slot 2) finish
    scheduler.add(d, 0.0)
    scheduler.add(e, 0.0)
    out = scheduler.schedule(0.0)
    assert (d.slot, e.slot) == (0, 2)
    assert out.decode_seqs == [b] and ids(out.prefill_seqs) == ["d", "e"]
    assert sorted(out.released) == [0, 2]
    answer(scheduler, out)
    assert ids(scheduler.schedule(0.0).decode_seqs) == ["d", "b", "e"]  # slot order


def test_static_policy_admits_only_into_an_empty_batch() -> None:
    a, b, c, d = seq("a", max_tokens=1), seq("b", max_tokens=2), seq("c"), seq("d")
    scheduler = scheduler_with(a, b, c, d, batching=BatchingPolicy.STATIC)
    out = step(scheduler)  # a finishes: slot 0 is free, b still runs
    assert ids(out.admitted) == ["a", "b"]
    out = step(scheduler)  # b finishes: the batch is empty
    assert out.admitted == [] and out.decode_seqs == [b] and out.prefills == []
    out = scheduler.schedule(0.0)
    assert ids(out.admitted) == ["c", "d"]


def test_continuous_policy_admits_into_any_free_slot() -> None:
    a, b, c = seq("a", max_tokens=1), seq("b", max_tokens=2), seq("c")
    scheduler = scheduler_with(a, b, c, batching=BatchingPolicy.CONTINUOUS)
    step(scheduler)
    assert ids(scheduler.schedule(0.0).admitted) == ["c"]


# --- the token budget and chunked prefill ------------------------------------------------------


def test_config_refuses_a_budget_below_the_slot_count() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(num_slots=4, max_num_batched_tokens=3)
    assert SchedulerConfig(num_slots=4, max_num_batched_tokens=4).max_num_batched_tokens == 4
    with pytest.raises(ValueError, match="max_prefill_chunk"):
        SchedulerConfig(num_slots=1, max_prefill_chunk=0)
    with pytest.raises(ValueError, match="num_slots"):
        SchedulerConfig(num_slots=0)


def test_decodes_are_served_before_prompt_chunks() -> None:
    """The budget goes to every decoding request first, then to the prefilling ones."""
    a, b = seq("a"), seq("b")
    scheduler = configured(SchedulerConfig(3, max_num_batched_tokens=5), a, b)
    step(scheduler)  # a and b prefilled: both decode from now on
    c = seq("c", prompt=list(range(1, 11)))
    scheduler.add(c, 0.0)
    out = scheduler.schedule(0.0)
    assert out.decode_seqs == [a, b]
    assert chunks(out) == [("c", 0, 3, False)]  # what the two decodes left of 5
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (2, 3)
    assert out.num_outputs == 2  # a partial chunk samples nothing
    outcome = answer(scheduler, out)
    assert c.generated == [] and c.num_computed_tokens == 3 and c.prefilling
    assert outcome.num_generated == outcome.num_decode_generated == 2
    assert c.times.first_token is None


def test_a_long_prompt_is_prefilled_over_several_steps_while_others_decode() -> None:
    a = seq("a", max_tokens=100)
    scheduler = configured(SchedulerConfig(2, max_num_batched_tokens=4), a)
    step(scheduler)
    long = seq("long", prompt=list(range(1, 11)))
    scheduler.add(long, 0.0)
    seen = []
    for _ in range(4):
        out = step(scheduler)
        assert out.decode_seqs[0] is a  # a decodes every step
        seen.append(chunks(out))
    assert seen == [
        [("long", 0, 3, False)],
        [("long", 3, 3, False)],
        [("long", 6, 3, False)],
        [("long", 9, 1, True)],
    ]
    assert long.num_generated == 1 and not long.prefilling
    assert ids(scheduler.schedule(0.0).decode_seqs) == ["a", "long"]


def test_chunk_cap_limits_each_requests_prompt_tokens_per_step() -> None:
    a, b = seq("a", prompt=list(range(1, 11))), seq("b", prompt=list(range(1, 6)))
    scheduler = configured(SchedulerConfig(2, max_prefill_chunk=4), a, b)
    assert chunks(step(scheduler)) == [("a", 0, 4, False), ("b", 0, 4, False)]
    assert chunks(step(scheduler)) == [("a", 4, 4, False), ("b", 4, 1, True)]
    out = step(scheduler)
    assert out.decode_seqs == [b] and chunks(out) == [("a", 8, 2, True)]
    assert a.num_computed_tokens == 10 and a.num_generated == 1


def test_chunks_feed_the_right_tokens_at_the_right_positions() -> None:
    prompt = list(range(100, 111))
    a = seq("a", prompt=prompt)
    scheduler = configured(SchedulerConfig(1, max_num_batched_tokens=4), a)
    fed: list[int] = []
    for _ in range(3):
        out = step(scheduler)
        (chunk,) = out.prefills
        assert chunk.start == len(fed) and chunk.slot == 0 and chunk.request_id == "a"
        assert chunk.fresh == (chunk.start == 0)
        fed += chunk.token_ids
    assert fed == prompt


def test_admission_stops_when_the_budget_is_spent() -> None:
    a, b, c = seq("a", prompt=[1] * 6), seq("b", prompt=[1] * 3), seq("c")
    scheduler = configured(SchedulerConfig(3, max_num_batched_tokens=6), a, b, c)
    out = scheduler.schedule(0.0)
    assert out.admitted == [a] and chunks(out) == [("a", 0, 6, True)]
    assert (b.status, c.status) == (RequestStatus.WAITING, RequestStatus.WAITING)
    assert scheduler.slots.num_free == 2  # free slots, but no token left to feed them
    answer(scheduler, out)
    out = scheduler.schedule(0.0)
    # a decodes (1), b's whole prompt (3), c's whole prompt (2): 6
    assert out.decode_seqs == [a] and ids(out.admitted) == ["b", "c"]
    assert out.num_decode_tokens + out.num_prefill_tokens == 6


def test_prefilling_requests_get_the_budget_before_new_admissions() -> None:
    a = seq("a", prompt=[1] * 10)
    scheduler = configured(SchedulerConfig(2, max_num_batched_tokens=4), a)
    step(scheduler)
    b = seq("b")
    scheduler.add(b, 0.0)
    out = scheduler.schedule(0.0)
    assert chunks(out) == [("a", 4, 4, False)] and out.admitted == []


# --- preempt and resume -----------------------------------------------------------------------


def test_preempted_request_resumes_first_and_recomputes_prompt_and_generated_tokens() -> None:
    a, b = seq("a", max_tokens=20, prompt=[1, 2, 3]), seq("b")
    scheduler = configured(SchedulerConfig(1, max_num_batched_tokens=4), a, b)
    step(scheduler, token=11, now=1.0)
    step(scheduler, token=12, now=2.0)
    step(scheduler, token=13, now=3.0)
    assert a.tokens == [1, 2, 3, 11, 12, 13] and a.times.first_token == 1.0
    scheduler.preempt(a, 4.0)
    assert a.status is RequestStatus.PREEMPTED and a.slot is None
    assert a.num_computed_tokens == 0 and a.num_preemptions == 1
    assert used(scheduler) == 0
    assert scheduler.waiting.peek() is a  # ahead of b, which arrived earlier
    # a comes back in the next step: the released slot, then prompt + generated tokens as a
    # chunked prefill counted as prefill tokens, without a new token until the last chunk
    out = scheduler.schedule(5.0)
    assert out.preempted == [a] and out.released == [0]
    assert out.resumed == [a] and out.admitted == []
    assert chunks(out) == [("a", 0, 4, False)] and out.prefills[0].token_ids == [1, 2, 3, 11]
    assert out.num_prefill_tokens == 4 and out.num_decode_tokens == 0
    answer(scheduler, out, token=99, now=5.0)
    assert a.tokens == [1, 2, 3, 11, 12, 13]  # a partial chunk adds nothing
    out = scheduler.schedule(6.0)
    assert chunks(out) == [("a", 4, 2, True)] and out.prefills[0].token_ids == [12, 13]
    assert out.resumed == []
    answer(scheduler, out, token=14, now=6.0)
    assert a.tokens == [1, 2, 3, 11, 12, 13, 14]
    assert a.times.first_token == a.times.admitted == 1.0  # not reset by the resume
    assert status(a) is RequestStatus.RUNNING and not a.prefilling
    assert b.status is RequestStatus.WAITING


def test_a_resumed_request_keeps_its_token_limit() -> None:
    a = seq("a", max_tokens=3, prompt=[1])
    scheduler = scheduler_with(a, num_slots=1)
    step(scheduler)
    step(scheduler)
    scheduler.preempt(a, 0.0)
    out = step(scheduler)  # recomputes [1, 5, 5] and samples the third token
    assert chunks(out) == [("a", 0, 3, True)]
    assert a.finish_reason is FinishReason.LENGTH and a.generated == [5, 5, 5]


def test_preempting_a_prefilling_request_restarts_its_prefill() -> None:
    a = seq("a", prompt=list(range(1, 9)))
    scheduler = configured(SchedulerConfig(1, max_num_batched_tokens=3), a)
    step(scheduler)
    scheduler.preempt(a, 0.0)
    out = scheduler.schedule(0.0)
    assert out.resumed == [a] and chunks(out) == [("a", 0, 3, False)]


def test_only_a_running_request_can_be_preempted() -> None:
    a, b = seq("a"), seq("b")
    scheduler = scheduler_with(a, b, num_slots=1)
    scheduler.schedule(0.0)
    with pytest.raises(ValueError, match="'b'"):
        scheduler.preempt(b, 0.0)
    scheduler.preempt(a, 0.0)
    with pytest.raises(ValueError, match="'a'"):
        scheduler.preempt(a, 0.0)


def test_a_preempted_request_can_be_aborted_while_it_waits() -> None:
    a, b = seq("a"), seq("b")
    scheduler = scheduler_with(a, b, num_slots=1)
    step(scheduler)
    scheduler.preempt(a, 1.0)
    assert scheduler.abort("a", 2.0) is a
    assert a.finish_reason is FinishReason.ABORT and a.status is RequestStatus.FINISHED
    assert ids(scheduler.schedule(2.0).admitted) == ["b"]


def test_a_request_preempted_during_a_model_call_is_never_run_after_it_finished() -> None:
    """Regression: a request preempted between schedule() and update() got that call's token;
    when the token ended it, it was FINISHED but left in the queue, and the next schedule()
    resumed it."""
    a = seq("a", max_tokens=2, prompt=[1, 2, 3])
    scheduler = scheduler_with(a, num_slots=1)
    step(scheduler)
    out = scheduler.schedule(0.0)  # a decodes its last allowed token in this call
    scheduler.preempt(a, 0.0)
    outcome = answer(scheduler, out, token=6)
    assert outcome.finished == [] and outcome.num_generated == 0  # the token is dropped
    assert a.generated == [5] and status(a) is RequestStatus.PREEMPTED and not a.finished
    following = scheduler.schedule(0.0)  # a resumes and samples that token again
    assert following.resumed == [a] and chunks(following) == [("a", 0, 4, True)]
    answer(scheduler, following, token=6)
    assert a.generated == [5, 6] and a.finish_reason is FinishReason.LENGTH
    assert not scheduler.has_work()


def test_a_prefilling_request_preempted_during_a_model_call_restarts_its_prefill() -> None:
    a = seq("a", prompt=list(range(1, 9)))
    scheduler = configured(SchedulerConfig(1, max_num_batched_tokens=3), a)
    out = scheduler.schedule(0.0)
    scheduler.preempt(a, 0.0)
    answer(scheduler, out)
    assert a.num_computed_tokens == 0 and a.prefilled == 0
    assert chunks(scheduler.schedule(0.0)) == [("a", 0, 3, False)]


# --- the KV books -----------------------------------------------------------------------------


def test_blocks_follow_the_computed_tokens() -> None:
    a = seq("a", max_tokens=50, prompt=[1] * 5)
    scheduler = configured(SchedulerConfig(1, block_size=4, kv_cache_tokens=64), a)
    assert scheduler.books.total == 16
    for _ in range(8):
        step(scheduler)
        assert blocks(scheduler, a) == -(-a.num_computed_tokens // 4) == used(scheduler)
    assert a.num_computed_tokens == 12


def test_kv_capacity_is_rounded_down_to_whole_blocks() -> None:
    scheduler = Scheduler(SchedulerConfig(1, block_size=16, kv_cache_tokens=100))
    assert scheduler.books.total == 6 and scheduler.books.capacity_tokens == 96


def test_decodes_that_do_not_fit_preempt_the_most_recently_admitted_request() -> None:
    a, b = seq("a", max_tokens=4, prompt=[1]), seq("b", max_tokens=4, prompt=[1])
    config = SchedulerConfig(2, block_size=2, kv_cache_tokens=4)  # 2 blocks: each fits alone
    scheduler = configured(config, a, b)
    step(scheduler)  # each computed 1 token: one block each
    step(scheduler)  # each computed 2 tokens: still one block each
    assert used(scheduler) == scheduler.books.total == 2
    out = scheduler.schedule(1.0)  # each needs a second block: only one can have it
    assert out.preempted == [b] and out.decode_seqs == [a]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert out.released == [1] and out.resumed == []  # no room for b to come back yet
    assert scheduler.waiting.peek() is b
    answer(scheduler, out)
    assert blocks(scheduler, a) == used(scheduler) == 2
    while scheduler.has_work():  # a finishes, then b resumes and finishes too
        step(scheduler)
    assert a.generated == b.generated == [5] * 4 and b.num_preemptions == 1


def test_a_request_waits_while_no_block_is_free_for_its_first_chunk() -> None:
    a, b = seq("a", max_tokens=2, prompt=[1] * 7), seq("b", max_tokens=1, prompt=[1])
    config = SchedulerConfig(2, block_size=2, kv_cache_tokens=8)
    scheduler = configured(config, a)
    step(scheduler)  # a holds all 4 blocks (7 tokens; its 8th fits the last one)
    scheduler.add(b, 0.0)
    out = scheduler.schedule(0.0)
    assert out.decode_seqs == [a] and out.preempted == []
    assert out.admitted == [] and b.status is RequestStatus.WAITING and b.slot is None
    assert scheduler.slots.num_free == 1  # a free slot, but no free block
    answer(scheduler, out)  # a finishes: b gets in
    assert a.finish_reason is FinishReason.LENGTH
    assert scheduler.schedule(0.0).admitted == [b]


def test_released_blocks_let_a_waiting_request_in() -> None:
    a, b = seq("a", max_tokens=1, prompt=[1] * 4), seq("b", max_tokens=3, prompt=[1, 2])
    scheduler = configured(SchedulerConfig(2, block_size=2, kv_cache_tokens=4), a, b)
    out = scheduler.schedule(0.0)
    assert out.admitted == [a]  # a's prompt takes both blocks
    answer(scheduler, out)  # a finishes: its blocks are free
    assert used(scheduler) == 0
    out = scheduler.schedule(0.0)
    assert out.admitted == [b] and chunks(out) == [("b", 0, 2, True)]


def test_prefilling_requests_that_fill_the_kv_cache_between_them_make_progress() -> None:
    """Regression: two partly prefilled requests that filled the KV cache between them
    deadlocked (neither had room for its next chunk and nothing decoded, so schedule()
    returned an empty output forever). Now the most recently admitted one is preempted."""
    a, b = seq("a", max_tokens=3, prompt=[1] * 6), seq("b", max_tokens=3, prompt=[1] * 6)
    config = SchedulerConfig(
        2, max_num_batched_tokens=4, max_prefill_chunk=2, block_size=2, kv_cache_tokens=8
    )  # either request fits the cache alone (6 + 3 - 1 tokens: 4 blocks)
    scheduler = configured(config, a, b)
    preempted: list[Sequence] = []
    for _ in range(30):
        if not scheduler.has_work():
            break
        out = scheduler.schedule(0.0)
        assert not out.empty, "no progress although requests are running"
        preempted += out.preempted
        answer(scheduler, out)
    assert a.generated == b.generated == [5, 5, 5]
    assert preempted and set(ids(preempted)) == {"b"}  # the younger one gave way


def test_a_request_that_can_never_fit_the_kv_cache_ends_at_once_with_an_error() -> None:
    """It needs prompt + max_tokens - 1 tokens of cache (its last token is never fed back):
    one more than the cache holds is refused before it waits, exactly as many runs."""
    config = SchedulerConfig(1, block_size=2, kv_cache_tokens=8)
    too_long, exact = seq("too_long", max_tokens=6, prompt=[1] * 4), seq("exact", 5, [1] * 4)
    scheduler = configured(config)
    assert scheduler.add(too_long, 1.0) is True
    assert too_long.finish_reason is FinishReason.ERROR and too_long.slot is None
    assert isinstance(too_long.error, ValueError) and "too_long" in str(too_long.error)
    assert not scheduler.has_work()
    assert scheduler.add(exact, 1.0) is False
    while scheduler.has_work():
        out = step(scheduler)
        assert out.preempted == []
    assert exact.generated == [5] * 5 and exact.num_preemptions == 0


# --- aborts -----------------------------------------------------------------------------------


def test_abort_of_a_waiting_request() -> None:
    a, b, c = seq("a"), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c, num_slots=1)
    scheduler.schedule(0.0)
    assert scheduler.abort("b", 1.0) is b
    assert b.finish_reason is FinishReason.ABORT and b.times.finished == 1.0
    assert "b" not in scheduler.waiting and b.slot is None
    # c keeps its place and b is never admitted
    scheduler.abort("a", 1.0)
    assert scheduler.schedule(1.0).admitted == [c]


def test_abort_of_a_running_request_frees_its_slot_for_a_waiting_one() -> None:
    a, b, c = seq("a"), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c)
    step(scheduler)
    assert scheduler.abort("b", 1.0) is b
    assert b.finish_reason is FinishReason.ABORT and b.slot is None and b.num_computed_tokens == 0
    assert scheduler.slots.num_free == 1
    out = scheduler.schedule(1.0)
    assert out.admitted == [c] and c.slot == 1 and out.released == [1]
    assert out.decode_seqs == [a]


def test_abort_of_a_prefilling_request() -> None:
    a = seq("a", prompt=[1] * 10)
    scheduler = configured(SchedulerConfig(1, max_num_batched_tokens=4), a)
    step(scheduler)
    assert scheduler.abort("a", 0.0) is a
    assert not scheduler.has_work() and used(scheduler) == 0
    assert scheduler.schedule(0.0).empty


def test_abort_between_schedule_and_update_drops_that_token() -> None:
    a, b = seq("a"), seq("b")
    scheduler = scheduler_with(a, b)
    step(scheduler, token=4)
    out = scheduler.schedule(0.0)
    scheduler.abort("a", 0.0)
    outcome = scheduler.update(out, ModelOutput([STOP, 5]), 0.0)
    assert outcome.finished == []  # a was aborted, not stopped
    assert outcome.num_generated == 1 and outcome.error is None  # b's token only
    assert a.finish_reason is FinishReason.ABORT and a.generated == [4]
    assert b.generated == [4, 5]
    assert used(scheduler) == blocks(scheduler, b) == 1


def test_abort_of_a_request_admitted_in_the_running_step_drops_its_first_token() -> None:
    a = seq("a")
    scheduler = scheduler_with(a)
    out = scheduler.schedule(0.0)
    scheduler.abort("a", 0.0)
    outcome = answer(scheduler, out)
    assert a.generated == [] and a.times.first_token is None and outcome.num_generated == 0
    assert used(scheduler) == 0


def test_a_scheduler_outputs_decodes_are_unchanged_by_later_slot_changes() -> None:
    """The engine runs an output in a worker thread while aborts and admissions go on; the
    requests the model was given must not change under it, and the next output must see the
    new table."""
    a, b, c = seq("a"), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c)
    step(scheduler)
    out = scheduler.schedule(0.0)
    scheduler.abort("a", 0.0)
    assert out.decode_seqs == [a, b]
    answer(scheduler, out)
    following = step(scheduler)
    assert following.decode_seqs == [b] and following.prefill_seqs == [c]
    assert out.decode_seqs == [a, b]
    decodes = scheduler.schedule(0.0)
    assert decodes.decode_seqs == [c, b]
    answer(scheduler, decodes)
    assert scheduler.schedule(0.0).decode_seqs is decodes.decode_seqs  # unchanged: one list


def test_abort_of_unknown_or_finished_request_is_a_no_op() -> None:
    a = seq("a", max_tokens=1)
    scheduler = scheduler_with(a)
    assert scheduler.abort("nope", 0.0) is None
    step(scheduler)
    assert scheduler.abort("a", 0.0) is None
    assert a.finish_reason is FinishReason.LENGTH


def test_abort_waiting_leaves_running_requests_alone() -> None:
    a, b, c = seq("a"), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c, num_slots=1)
    scheduler.schedule(0.0)
    assert scheduler.abort_waiting(0.0) == [b, c]
    assert a.finish_reason is None and a.slot == 0
    assert b.finish_reason is c.finish_reason is FinishReason.ABORT


def test_abort_all_and_fail_all_end_everything() -> None:
    a, b = seq("a"), seq("b")
    scheduler = scheduler_with(a, b, num_slots=1)
    scheduler.schedule(0.0)
    assert set(ids(scheduler.abort_all(0.0))) == {"a", "b"}
    assert not scheduler.has_work() and scheduler.slots.num_free == 1

    c, d = seq("c"), seq("d")
    scheduler = scheduler_with(c, d, num_slots=1)
    scheduler.schedule(0.0)
    err = RuntimeError("dead")
    assert set(ids(scheduler.fail_all(err, 0.0))) == {"c", "d"}
    assert c.finish_reason is d.finish_reason is FinishReason.ERROR
    assert c.error is err and d.error is err
    assert not scheduler.has_work() and used(scheduler) == 0


# --- failures ---------------------------------------------------------------------------------


def test_fail_ends_exactly_the_outputs_requests_with_error() -> None:
    a, b, c = seq("a"), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c)
    out = scheduler.schedule(0.0)
    scheduler.abort("b", 0.0)  # aborted during the failed call: stays ABORT
    err = RuntimeError("boom")
    outcome = scheduler.fail(out, err, 1.0)
    assert outcome.finished == [a] and outcome.error is err and outcome.num_generated == 0
    assert a.finish_reason is FinishReason.ERROR and a.error is err
    assert b.finish_reason is FinishReason.ABORT and b.error is None
    assert c.finish_reason is None and "c" in scheduler.waiting  # not in the call
    out = scheduler.schedule(1.0)
    assert out.prefill_seqs == [c] and sorted(out.released) == [0, 1]
    assert used(scheduler) == 0


def test_released_slots_reach_the_next_output_that_runs() -> None:
    """A driver skips an empty output; its released slots must not be lost, or a cached model
    would find the slot's old cache when the slot is reused."""
    a = seq("a", max_tokens=1)
    scheduler = scheduler_with(a, num_slots=1)
    step(scheduler)
    empty = scheduler.schedule(0.0)
    assert empty.empty and empty.released == []
    b = seq("b")
    scheduler.add(b, 0.0)
    out = scheduler.schedule(0.0)
    assert out.admitted == [b] and out.released == [0]
    answer(scheduler, out)
    assert scheduler.schedule(0.0).released == []  # handed out once


def test_take_released_hands_the_pending_releases_over_once() -> None:
    a = seq("a", max_tokens=1)
    scheduler = scheduler_with(a, num_slots=1)
    step(scheduler)
    assert scheduler.take_released() == [0]
    assert scheduler.take_released() == []


# --- SlotTable and WaitingQueue ---------------------------------------------------------------


def test_slot_table_bookkeeping() -> None:
    table = SlotTable(3)
    a, b, c, d = seq("a"), seq("b"), seq("c"), seq("d")
    assert [table.allocate(s) for s in (a, b, c)] == [0, 1, 2]
    assert table.num_free == 0 and table.occupied == 3
    with pytest.raises(RuntimeError, match="no free slot"):
        table.allocate(d)
    assert table.release(b) == 1
    assert b.slot is None and table.get(1) is None
    assert list(table.running()) == [a, c]
    with pytest.raises(RuntimeError, match="'b'"):
        table.release(b)
    assert table.allocate(d) == 1 and table.get(1) is d
    assert table.num_free + table.occupied == table.capacity


@pytest.mark.parametrize("capacity", [0, -1])
def test_slot_table_needs_a_slot(capacity: int) -> None:
    with pytest.raises(ValueError, match="num_slots"):
        SlotTable(capacity)


def test_waiting_queue_is_fifo_with_removal_anywhere() -> None:
    queue = WaitingQueue()
    seqs = [seq(r) for r in "abcde"]
    for s in seqs:
        queue.push(s)
    assert len(queue) == 5 and "c" in queue
    assert queue.remove("c") is seqs[2]
    assert queue.remove("c") is None
    assert "c" not in queue
    assert queue.pop() is seqs[0]
    assert queue.drain() == [seqs[1], seqs[3], seqs[4]]
    assert len(queue) == 0 and not queue


def test_waiting_queue_push_front_goes_ahead_of_earlier_arrivals() -> None:
    queue = WaitingQueue()
    a, b, c = seq("a"), seq("b"), seq("c")
    queue.push(a)
    queue.push(b)
    queue.push_front(c)
    assert queue.peek() is c and queue.drain() == [c, a, b]


def test_a_decode_with_no_token_left_fails_that_request_alone() -> None:
    """A model answers NO_TOKEN for a row whose bans leave nothing to sample, on any step: the
    request ends with an error (never a token -1 in its output); its neighbour decodes on."""
    banned = Sequence("banned", [1, 2], 10, frozenset({STOP}),
                      sampling=SamplingParams(bad_words=((9,),)))  # fmt: skip
    plain = seq("plain")
    scheduler = scheduler_with(banned, plain)
    step(scheduler)  # both prefill and sample their first token
    out = scheduler.schedule(0.0)
    tokens = [NO_TOKEN if s is banned else 5 for s in out.decode_seqs]
    scheduler.update(out, ModelOutput(tokens), 0.0)
    assert banned.finish_reason is FinishReason.ERROR and NO_TOKEN not in banned.tokens
    assert status(plain) is RequestStatus.RUNNING and plain.tokens[-1] == 5
