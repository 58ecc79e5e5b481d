"""Regression tests for what a senior review of the engine contract found, each named after
the bug (probe scripts reproduced each one before the fix)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import ClientFactory, serving_of

from app import ModelError, Request, generate
from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.scheduler import BatchingPolicy, Scheduler, SchedulerConfig
from app.engine.step import ModelOutput
from app.engine.stop_strings import StopStrings
from app.engine.types import FinishReason, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import StepBatch
from app.models.tokenizer import ByteTokenizer
from app.serving import GenerationParams

NEVER = -1
LANGUAGE = MockLanguage(text=False, vocab_size=50, stop_token=7, stop_probability=0.0)


def seq(rid: str, prompt: list[int], max_tokens: int, stop: int = NEVER) -> Sequence:
    return Sequence(rid, list(prompt), max_tokens, frozenset({stop}))


class HangingRelease(CachedMockModel):
    """A cached mock whose release never returns once ``hang`` is set."""

    blocking = True

    def __init__(self) -> None:
        super().__init__(2, LANGUAGE)
        self.hang = threading.Event()
        self.never = threading.Event()

    def release(self, slot: int) -> None:
        if self.hang.is_set():
            self.never.wait(30)
        super().release(slot)


async def test_stop_returns_when_the_models_slot_release_hangs() -> None:
    model = HangingRelease()
    engine = Engine(model, EngineConfig(num_slots=2))
    await engine.start()
    await engine.submit(seq("a", [1, 2], 3)).collect()
    model.hang.set()
    started = time.monotonic()
    await engine.stop(call_timeout=0.3)
    assert time.monotonic() - started < 5
    await asyncio.wait_for(engine.wait_idle(), 1)
    model.never.set()


class FailsOnPrompt(CachedMockModel):
    def step(self, batch: StepBatch) -> list[int]:
        if any(chunk.token_ids[:1] == [42] for chunk in batch.prefills):
            raise RuntimeError("bad prompt")
        return super().step(batch)


async def test_a_failed_first_chunk_does_not_take_its_slot_out_of_service() -> None:
    engine = Engine(FailsOnPrompt(1, LANGUAGE), EngineConfig(num_slots=1))
    await engine.start()
    try:
        _, reason, _ = await engine.submit(seq("bad", [42], 3)).collect()
        assert reason is FinishReason.ERROR
        tokens, reason, _ = await asyncio.wait_for(engine.submit(seq("ok", [1], 3)).collect(), 5)
        assert reason is FinishReason.LENGTH and len(tokens) == 3
        assert engine.core.scheduler.slots.out_of_service == frozenset()
    finally:
        await engine.stop()


class NeverResets(CachedMockModel):
    def release(self, slot: int) -> None:
        raise RuntimeError("device lost")


def test_generate_raises_instead_of_spinning_when_no_slot_can_be_reset() -> None:
    requests = [Request("a", [1], 3), Request("b", [2], 3)]
    with pytest.raises(ModelError, match="failed to reset slots") as info:
        generate(NeverResets(1, LANGUAGE), requests, 1, NEVER)
    assert len(info.value.partial["a"]) == 3 and info.value.partial["b"] == []


async def test_every_slot_out_of_service_turns_health_to_no_slot(
    make_client: ClientFactory,
) -> None:
    async with make_client(NeverResets(1, LANGUAGE), num_slots=1) as client:
        first = await client.post("/generate", json={"prompt": [1], "max_tokens": 2})
        assert first.status_code == 200
        serving = serving_of(client)
        # the next request is scheduled on the released slot, whose reset fails
        stream = serving.submit(GenerationParams(prompt=[2], max_tokens=2))
        deadline = time.monotonic() + 5
        while serving.state != "no_slot" and time.monotonic() < deadline:  # noqa: ASYNC110 (a condition, no event)
            await asyncio.sleep(0.01)
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "no_slot"
        assert (await client.get("/slots")).json()["slots"][0]["out_of_service"] is True
        serving.abort(stream.request_id)


def test_the_default_kv_capacity_never_binds_and_usage_stays_at_most_one() -> None:
    config = SchedulerConfig(4, block_size=16, kv_cache_tokens=4 * 112, max_model_len=100)
    assert not config.kv_binds  # 100 tokens take 7 blocks of 16: 4 x 7 x 16 = 448 tokens
    scheduler = Scheduler(config)
    seqs = [seq(f"r{i}", [1] * 40, 60) for i in range(4)]
    for s in seqs:
        scheduler.add(s, 0.0)
    peak = 0.0
    while scheduler.has_work():
        out = scheduler.schedule(0.0)
        scheduler.update(out, ModelOutput([1] * out.num_outputs), 0.0)
        peak = max(peak, scheduler.books.usage(scheduler.slots.running()))
    assert 0 < peak <= 1.0


def test_static_batching_under_a_budget_fills_every_slot_at_once() -> None:
    config = SchedulerConfig(4, BatchingPolicy.STATIC, max_num_batched_tokens=4)
    scheduler = Scheduler(config)
    for i in range(8):
        scheduler.add(seq(f"r{i}", [1] * 10, 2), 0.0)
    out = scheduler.schedule(0.0)
    assert len(out.admitted) == 4 and scheduler.slots.num_free == 0
    assert out.num_prefill_tokens <= 4


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop() -> None:
    tokenizer = ByteTokenizer()
    a = Sequence("a", list(b"he"), 3, frozenset({256}),
                 stop=StopStrings(["llo"], tokenizer.stream_decoder()))  # fmt: skip
    scheduler = Scheduler(1)
    scheduler.add(a, 0.0)
    for token in b"llo":
        out = scheduler.schedule(0.0)
        scheduler.update(out, ModelOutput([token]), 0.0)
    assert a.finish_reason is FinishReason.STOP and bytes(a.generated) == b"llo"


def test_a_stop_token_left_out_of_the_output_is_not_counted_as_generated() -> None:
    a = seq("a", [1], 5, stop=7)
    scheduler = Scheduler(1)
    scheduler.add(a, 0.0)
    counted = 0
    for token in (3, 4, 7):
        out = scheduler.schedule(0.0)
        counted += scheduler.update(out, ModelOutput([token]), 0.0).num_generated
    assert a.generated == [3, 4] and counted == 2


def test_the_engine_refuses_a_request_that_can_never_fit_the_kv_cache() -> None:
    scheduler = Scheduler(SchedulerConfig(1, block_size=4, kv_cache_tokens=16))
    big = seq("big", [1] * 14, 5)
    assert scheduler.add(big, 0.0) is True
    assert big.finish_reason is FinishReason.ERROR and "KV" in str(big.error)
    assert not scheduler.has_work()


async def test_wait_idle_returns_after_stopping_an_engine_that_never_started() -> None:
    engine = Engine(MockModel(LANGUAGE), EngineConfig(num_slots=1))
    await engine.stop()
    await asyncio.wait_for(engine.wait_idle(), 1)
