"""Unit tests of the one slot logic: Scheduler, SlotTable and WaitingQueue."""

from __future__ import annotations

import pytest

from app.engine.scheduler import BatchingPolicy, Scheduler
from app.engine.slots import SlotTable
from app.engine.types import FinishReason, Sequence
from app.engine.waiting import WaitingQueue

STOP = 0


def seq(rid: str, max_tokens: int = 10, prompt: list[int] | None = None) -> Sequence:
    return Sequence(rid, list(prompt or [1, 2]), max_tokens, frozenset({STOP}))


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def scheduler_with(*seqs: Sequence, num_slots: int = 2, **kwargs: object) -> Scheduler:
    scheduler = Scheduler(num_slots, **kwargs)  # type: ignore[arg-type]
    for s in seqs:
        scheduler.add(s, 0.0)
    return scheduler


# --- admission --------------------------------------------------------------------------------


def test_admits_in_arrival_order_up_to_the_slot_count() -> None:
    a, b, c = seq("a"), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c)
    plan = scheduler.schedule(1.0)
    assert ids(plan.batch) == ["a", "b"]
    assert ids(plan.admitted) == ["a", "b"]
    assert (a.slot, b.slot, c.slot) == (0, 1, None)
    assert "c" in scheduler.waiting
    assert a.times.admitted == 1.0 and c.times.admitted is None


def test_max_tokens_zero_finishes_at_once_and_never_runs() -> None:
    z = seq("z", max_tokens=0)
    scheduler = Scheduler(2)
    assert scheduler.add(z, 0.0) is True
    assert z.finish_reason is FinishReason.LENGTH and z.generated == []
    assert not scheduler.has_work()
    assert scheduler.schedule(0.0).batch == []


def test_slot_freed_by_a_finish_is_refilled_in_the_same_schedule() -> None:
    a, b, c = seq("a", max_tokens=1), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c)
    plan = scheduler.schedule(0.0)
    finished = scheduler.apply(plan, [5, 5], 0.0)
    assert finished == [a] and plan.finished == [a]
    assert a.finish_reason is FinishReason.LENGTH and a.slot is None
    plan = scheduler.schedule(0.0)
    assert ids(plan.batch) == ["c", "b"]  # c took a's slot 0
    assert plan.admitted == [c] and plan.released == [0]
    assert c.slot == 0


def test_stop_token_finishes_and_is_kept_only_with_include_stop() -> None:
    a, b = seq("a"), seq("b")
    b.include_stop = True
    scheduler = scheduler_with(a, b)
    plan = scheduler.schedule(0.0)
    scheduler.apply(plan, [STOP, STOP], 0.0)
    assert (a.finish_reason, b.finish_reason) == (FinishReason.STOP, FinishReason.STOP)
    assert a.generated == [] and b.generated == [STOP]
    assert scheduler.slots.occupied == 0


def test_any_of_several_stop_tokens_finishes() -> None:
    a = Sequence("a", [1], 10, frozenset({3, 4}))
    scheduler = scheduler_with(a)
    scheduler.apply(scheduler.schedule(0.0), [4], 0.0)
    assert a.finish_reason is FinishReason.STOP


def test_apply_needs_one_token_per_batch_entry() -> None:
    scheduler = scheduler_with(seq("a"), seq("b"))
    plan = scheduler.schedule(0.0)
    with pytest.raises(ValueError):
        scheduler.apply(plan, [1], 0.0)


def test_first_token_time_is_recorded_once() -> None:
    a = seq("a")
    scheduler = scheduler_with(a)
    scheduler.apply(scheduler.schedule(1.0), [5], 2.0)
    scheduler.apply(scheduler.schedule(3.0), [5], 4.0)
    assert a.times.first_token == 2.0


def test_lowest_free_slot_is_used_first() -> None:
    a, b, c = seq("a", max_tokens=1), seq("b"), seq("c", max_tokens=1)
    d, e = seq("d"), seq("e")
    scheduler = scheduler_with(a, b, c, num_slots=3)
    plan = scheduler.schedule(0.0)
    scheduler.apply(plan, [5, 5, 5], 0.0)  # a (slot 0) and c (slot 2) finish
    scheduler.add(d, 0.0)
    scheduler.add(e, 0.0)
    plan = scheduler.schedule(0.0)
    assert (d.slot, e.slot) == (0, 2)
    assert ids(plan.batch) == ["d", "b", "e"]  # slot order
    assert sorted(plan.released) == [0, 2]


def test_static_policy_admits_only_into_an_empty_batch() -> None:
    a, b, c, d = seq("a", max_tokens=1), seq("b", max_tokens=2), seq("c"), seq("d")
    scheduler = scheduler_with(a, b, c, d, policy=BatchingPolicy.STATIC)
    plan = scheduler.schedule(0.0)
    assert ids(plan.admitted) == ["a", "b"]
    scheduler.apply(plan, [5, 5], 0.0)  # a finishes: slot 0 is free, b still runs
    plan = scheduler.schedule(0.0)
    assert plan.admitted == [] and ids(plan.batch) == ["b"]
    scheduler.apply(plan, [5], 0.0)  # b finishes: the batch is empty
    plan = scheduler.schedule(0.0)
    assert ids(plan.admitted) == ["c", "d"]


def test_continuous_policy_admits_into_any_free_slot() -> None:
    a, b, c = seq("a", max_tokens=1), seq("b", max_tokens=2), seq("c")
    scheduler = scheduler_with(a, b, c, policy=BatchingPolicy.CONTINUOUS)
    scheduler.apply(scheduler.schedule(0.0), [5, 5], 0.0)
    assert ids(scheduler.schedule(0.0).admitted) == ["c"]


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
    scheduler.schedule(0.0)
    assert scheduler.abort("b", 1.0) is b
    assert b.finish_reason is FinishReason.ABORT and b.slot is None
    assert scheduler.slots.num_free == 1
    plan = scheduler.schedule(1.0)
    assert plan.admitted == [c] and c.slot == 1 and plan.released == [1]


def test_abort_between_schedule_and_apply_drops_that_token() -> None:
    a, b = seq("a"), seq("b")
    scheduler = scheduler_with(a, b)
    plan = scheduler.schedule(0.0)
    scheduler.abort("a", 0.0)
    finished = scheduler.apply(plan, [STOP, 5], 0.0)
    assert finished == []  # a was aborted, not stopped
    assert plan.applied == 1 and plan.error is None  # b's token only
    assert a.finish_reason is FinishReason.ABORT and a.generated == []
    assert b.generated == [5]


def test_a_plans_batch_is_unchanged_by_later_slot_changes() -> None:
    """The engine runs a plan in a worker thread while aborts and admissions go on; the batch the
    model was given must not change under it, and the next plan must see the new table."""
    a, b, c = seq("a"), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c)
    plan = scheduler.schedule(0.0)
    scheduler.abort("a", 0.0)
    assert plan.batch == [a, b]
    scheduler.apply(plan, [5, 5], 0.0)
    following = scheduler.schedule(0.0)
    assert following.batch == [c, b] and plan.batch == [a, b]
    assert scheduler.schedule(0.0).batch is following.batch  # unchanged table: the same list


def test_abort_of_unknown_or_finished_request_is_a_no_op() -> None:
    a = seq("a", max_tokens=1)
    scheduler = scheduler_with(a)
    assert scheduler.abort("nope", 0.0) is None
    scheduler.apply(scheduler.schedule(0.0), [5], 0.0)
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
    assert not scheduler.has_work()


# --- failures ---------------------------------------------------------------------------------


def test_fail_ends_exactly_the_plans_sequences_with_error() -> None:
    a, b, c = seq("a"), seq("b"), seq("c")
    scheduler = scheduler_with(a, b, c)
    plan = scheduler.schedule(0.0)
    scheduler.abort("b", 0.0)  # aborted during the failed call: stays ABORT
    err = RuntimeError("boom")
    failed = scheduler.fail(plan, err, 1.0)
    assert failed == [a] and plan.finished == [a] and plan.error is err
    assert a.finish_reason is FinishReason.ERROR and a.error is err
    assert b.finish_reason is FinishReason.ABORT and b.error is None
    assert c.finish_reason is None and "c" in scheduler.waiting  # not in the call
    plan = scheduler.schedule(1.0)
    assert plan.batch == [c] and sorted(plan.released) == [0, 1]


def test_released_slots_reach_the_next_plan_that_has_a_batch() -> None:
    """A driver skips a plan with an empty batch; its released slots must not be lost, or a
    cached model would find the slot's old cache when the slot is reused."""
    a = seq("a", max_tokens=1)
    scheduler = scheduler_with(a, num_slots=1)
    scheduler.apply(scheduler.schedule(0.0), [5], 0.0)
    empty = scheduler.schedule(0.0)
    assert empty.batch == []
    b = seq("b")
    scheduler.add(b, 0.0)
    plan = scheduler.schedule(0.0)
    assert plan.admitted == [b] and plan.released == [0]
    assert scheduler.schedule(0.0).released == []  # handed out once


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
