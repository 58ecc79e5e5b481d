"""The scheduler's side of prefill/decode disaggregation: a producer's finished prefill keeps
its blocks (in the KV books) until pulled or expired; a consumer's request starts after the
prompt tokens whose KV arrived, as after a prefix-cache hit."""

from __future__ import annotations

from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.step import ModelOutput, SchedulerOutput
from app.engine.types import FinishReason, Sequence

PROMPT = list(range(1, 41))  # 40 tokens: 10 blocks of 4


def request(rid: str, max_tokens: int, **fields: object) -> Sequence:
    s = Sequence(rid, list(PROMPT), max_tokens, frozenset({0}))
    for name, value in fields.items():
        setattr(s, name, value)
    return s


def run(scheduler: Scheduler, now: float = 0.0) -> SchedulerOutput:
    out = scheduler.schedule(now)
    scheduler.update(out, ModelOutput([5] * out.num_outputs), now)
    return out


def config(**fields: object) -> SchedulerConfig:
    return SchedulerConfig(2, block_size=4, kv_cache_tokens=400, **fields)  # type: ignore[arg-type]


def test_a_remote_decode_prefill_ended_by_length_holds_its_blocks_until_pulled() -> None:
    scheduler = Scheduler(config())
    producer = request("p", 1, remote_decode=True)
    scheduler.add(producer, 0.0)
    run(scheduler)
    assert producer.finish_reason is FinishReason.LENGTH and producer.slot is None
    assert producer.held is not None and len(producer.held) == 10
    assert scheduler.books.used(scheduler.slots.running()) == 10  # no request runs: the hold
    held = scheduler.release_held("p", 1.0)
    assert held is not None and held.num_tokens == 40
    assert scheduler.books.used(scheduler.slots.running()) == 0
    assert scheduler.release_held("p", 1.0) is None


def test_held_blocks_expire_when_a_step_is_planned_past_their_time() -> None:
    scheduler = Scheduler(config(kv_hold_seconds=5.0))
    scheduler.add(request("p", 1, remote_decode=True), 0.0)
    run(scheduler)
    scheduler.add(request("other", 2), 1.0)
    run(scheduler, 1.0)
    assert scheduler.holds.blocks == 10
    run(scheduler, 6.0)
    assert scheduler.holds.blocks == 0 and scheduler.holds.expired == 1


def test_a_request_ended_otherwise_or_not_asking_holds_nothing() -> None:
    scheduler = Scheduler(config())
    plain, aborted = request("plain", 1), request("gone", 5, remote_decode=True)
    scheduler.add(plain, 0.0)
    scheduler.add(aborted, 0.0)
    run(scheduler)
    scheduler.abort("gone", 0.0)
    assert plain.held is None and aborted.held is None and scheduler.holds.blocks == 0


def test_a_pulled_prompt_is_admitted_computed_but_its_last_token() -> None:
    scheduler = Scheduler(config())
    consumer = request("c", 3, remote_tokens=39)
    scheduler.add(consumer, 0.0)
    out = run(scheduler)
    chunk = out.prefills[0]
    assert (chunk.start, len(chunk.token_ids), out.num_prefill_tokens) == (39, 1, 1)
    assert tuple(chunk.prefix) == tuple(PROMPT[:39])  # the model gets the prompt it skipped
    assert out.remote_tokens == 39
    assert scheduler.books.used(scheduler.slots.running()) == 10  # its blocks are charged
    scheduler.preempt(consumer, 0.0)  # recomputed from 0 when it resumes: nothing arrives again
    out = run(scheduler)
    assert out.prefills[0].start == 0 and out.remote_tokens == 0
