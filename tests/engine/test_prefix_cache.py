"""The prefix cache (``--enable-prefix-caching``): chained block keys, hits that skip prefill,
shared blocks counted once in the KV books, least-recently-used eviction, hit counting, the
cached model's prefix contract, and outputs equal to the sequential reference."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from conftest import ClientFactory
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from reference import run_alone

from app.cli import parse, serve
from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.errors import UnsupportedFeatureError
from app.engine.prefix_cache import PrefixCache
from app.engine.runner import make_runner
from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.step import ModelOutput, SchedulerOutput
from app.engine.types import RequestStatus, Sequence
from app.models.cached_mock import CachedMockModel, SlotReuseError
from app.models.mock import MockModel
from app.models.protocol import DEFAULT_SAMPLING, PrefillChunk, StepBatch

STOP = 0
BS = 4  # block size in these tests


def seq(rid: str, prompt: list[int], max_tokens: int = 3) -> Sequence:
    return Sequence(rid, list(prompt), max_tokens, frozenset({STOP}))


def cached(
    num_slots: int = 4, kv_tokens: int | None = None, budget: int | None = None
) -> Scheduler:
    config = SchedulerConfig(
        num_slots,
        max_num_batched_tokens=budget,
        block_size=BS,
        kv_cache_tokens=kv_tokens,
        enable_prefix_caching=True,
    )
    return Scheduler(config)


def run_out(scheduler: Scheduler, s: Sequence, token: int = 7) -> None:
    """Add ``s`` and run steps (every output ``token``) until it has finished."""
    scheduler.add(s, 0.0)
    while s.status is not RequestStatus.FINISHED:
        out = scheduler.schedule(0.0)
        scheduler.update(out, ModelOutput([token] * out.num_outputs), 0.0)


def chunk_of(out: SchedulerOutput, rid: str) -> PrefillChunk:
    return next(c for s, c in zip(out.prefill_seqs, out.prefills, strict=True)
                if s.request_id == rid)  # fmt: skip


def referenced_blocks(scheduler: Scheduler) -> int:
    """Distinct cached blocks the running requests reference, counted from the requests."""
    return len({id(b) for s in scheduler.slots.running() if s.prefix for b in s.prefix.blocks})


# --- keys -------------------------------------------------------------------------------------


def test_block_keys_chain_over_the_whole_prefix_and_skip_the_partial_block() -> None:
    cache = PrefixCache(BS)
    a = cache.state(seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])).keys
    b = cache.state(seq("b", [1, 2, 3, 4, 5, 6, 7, 8])).keys
    c = cache.state(seq("c", [9, 9, 9, 9, 5, 6, 7, 8])).keys
    assert len(a) == 2  # token 9 is a partial block: never cached
    assert a == b  # the same prefix, the same keys
    assert c[0] != a[0] and c[1] != a[1]  # the same block after another parent: another key


def test_a_hash_collision_is_a_miss_not_a_wrong_prefix() -> None:
    cache = PrefixCache(BS)
    first = seq("a", [1, 2, 3, 4, 5])
    cache.acquire(first, [])
    first.status, first.prefilled = RequestStatus.RUNNING, 5
    cache.publish(first)
    other = seq("b", [8, 8, 8, 8, 5])
    cache.state(other).keys[0] = cache.state(first).keys[0]  # force the collision
    assert cache.lookup(other, 4) == []


# --- hits -------------------------------------------------------------------------------------


def test_a_cached_prefix_is_not_prefilled_again_and_is_counted_as_hits() -> None:
    scheduler = cached()
    run_out(scheduler, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 11, 12])
    scheduler.add(b, 0.0)
    out = scheduler.schedule(0.0)
    chunk = chunk_of(out, "b")
    assert (chunk.start, chunk.token_ids, list(chunk.prefix)) == (8, [11, 12], b.tokens[:8])
    assert out.num_prefill_tokens == 2  # the step clock charges b1 for these only
    assert (out.prefix_queries, out.prefix_hits) == (10, 8)


def test_a_request_that_skips_the_cache_is_not_counted_as_a_query() -> None:
    """Review (integration): a prompt_logprobs request skips the lookup (every prompt position
    must be computed) but its prompt was still added to vllm:prefix_cache_queries, so the hit
    rate read low under lm-eval traffic. As in vLLM, it is neither a query nor a hit."""
    scheduler = cached()
    run_out(scheduler, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
    b = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 11, 12], 3, frozenset({STOP}),
                 sampling=dataclasses.replace(DEFAULT_SAMPLING, prompt_logprobs=0))  # fmt: skip
    scheduler.add(b, 0.0)
    out = scheduler.schedule(0.0)
    assert chunk_of(out, "b").start == 0
    assert (out.prefix_queries, out.prefix_hits) == (0, 0)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler = cached()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    run_out(scheduler, seq("a", prompt))
    scheduler.add(seq("b", prompt), 0.0)
    chunk = chunk_of(scheduler.schedule(0.0), "b")
    assert (chunk.start, chunk.token_ids, chunk.sample) == (4, [5, 6, 7, 8], True)


def test_a_block_is_cached_as_soon_as_it_is_computed_so_concurrent_requests_share_it() -> None:
    scheduler = cached(budget=8)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    a = seq("a", [*shared, 9], max_tokens=20)
    scheduler.add(a, 0.0)
    scheduler.update(out := scheduler.schedule(0.0), ModelOutput([]), 0.0)  # 8 of 9 tokens
    assert out.num_prefill_tokens == 8 and a.prefilling
    scheduler.add(seq("b", [*shared, 10]), 0.0)
    out = scheduler.schedule(0.0)
    assert chunk_of(out, "b").start == 8
    assert scheduler.prefix_cache is not None and scheduler.prefix_cache.num_referenced == 2
    assert referenced_blocks(scheduler) == 2
    # a holds 2 shared blocks, b the same 2: 2 blocks in use, not 4
    assert scheduler.books.used(scheduler.slots.running()) == 2


def test_without_the_flag_nothing_is_cached() -> None:
    scheduler = Scheduler(SchedulerConfig(4, block_size=BS))
    run_out(scheduler, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    scheduler.add(seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]), 0.0)
    out = scheduler.schedule(0.0)
    assert chunk_of(out, "b").start == 0 and out.prefix_queries == out.prefix_hits == 0


# --- books and eviction -----------------------------------------------------------------------


def test_cached_blocks_nobody_uses_are_free_and_evicted_least_recently_used_first() -> None:
    scheduler = cached(num_slots=1, kv_tokens=6 * BS)
    cache = scheduler.prefix_cache
    assert cache is not None
    run_out(scheduler, seq("a", [1] * 8 + [2], max_tokens=1))  # caches 2 blocks (a1, a2)
    run_out(scheduler, seq("b", [3] * 8 + [4], max_tokens=1))  # caches 2 more (b1, b2)
    assert (cache.num_cached, cache.num_free, scheduler.books.used([])) == (4, 4, 0)
    # c takes 3 blocks, leaving room for 3 cached ones: the least recently used goes (a's),
    # and of a's blocks its tail before its head
    scheduler.add(seq("c", [5] * 9, max_tokens=1), 0.0)
    scheduler.schedule(0.0)
    assert cache.num_cached == 3
    assert len(cache.lookup(seq("a2", [1] * 8 + [6]), 8)) == 1
    assert len(cache.lookup(seq("b2", [3] * 8 + [6]), 8)) == 2


def test_a_hit_on_free_cached_blocks_takes_them_out_of_the_free_blocks() -> None:
    scheduler = cached(num_slots=2, kv_tokens=3 * BS)
    run_out(scheduler, seq("a", [1] * 8 + [2], max_tokens=1))
    assert scheduler.books.used([]) == 0  # a's 2 cached blocks are free
    scheduler.add(seq("b", [1] * 8 + [3], max_tokens=1), 0.0)
    scheduler.add(seq("c", [4] * 2), 0.0)
    out = scheduler.schedule(0.0)
    # b references the 2 cached blocks and takes the third for its last token: c must wait
    assert [s.request_id for s in out.prefill_seqs] == ["b"]
    assert scheduler.books.used(scheduler.slots.running()) == 2
    assert scheduler.waiting.peek().request_id == "c"


# --- the cached model's contract --------------------------------------------------------------


def test_cached_mock_copies_the_prefix_into_a_released_slot() -> None:
    model = CachedMockModel(1)
    tokens = [72, 101, 108, 108, 111, 32, 119]
    first = PrefillChunk(0, tokens, 0, True, DEFAULT_SAMPLING, "a")
    whole = model.step(StepBatch([], [], [], [], [first]))
    model.release(0)
    chunk = PrefillChunk(0, tokens[4:], 4, True, DEFAULT_SAMPLING, "b", tokens[:4])
    assert chunk.fresh
    assert model.step(StepBatch([], [], [], [], [chunk])) == whole
    assert model.cached_tokens(0) == len(tokens)
    with pytest.raises(SlotReuseError):  # not released: a prefix may not land on a used slot
        model.step(StepBatch([], [], [], [], [chunk]))


class NoPrefixModel:
    """A cached model that does not declare prefix caching (as a real model's runner might)."""

    def step(self, batch: StepBatch) -> list[int]:
        return [1] * batch.num_outputs

    def release(self, slot: int) -> None:
        pass


def test_a_model_without_prefix_caching_refuses_the_flag() -> None:
    with pytest.raises(UnsupportedFeatureError, match="prefix caching is not implemented"):
        Engine(NoPrefixModel(), EngineConfig(enable_prefix_caching=True))
    Engine(NoPrefixModel(), EngineConfig())  # without the flag it serves
    Engine(MockModel(), EngineConfig(enable_prefix_caching=True))  # stateless: always fine


# --- equal to the sequential reference --------------------------------------------------------


class HashLanguage:
    """Next token = a hash of the whole prefix: any wrong cached token changes the output."""

    stop_token = STOP

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def next_token(self, prefix: list[int]) -> int:
        return hash(tuple(prefix)) % self.vocab


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(3, 8),
    stateless=st.booleans(),
    num_slots=st.integers(1, 4),
    budget=st.integers(4, 24),
    kv_blocks=st.integers(6, 24),
)
def test_outputs_with_prefix_caching_equal_the_sequential_reference(
    data: st.DataObject, vocab: int, stateless: bool, num_slots: int, budget: int, kv_blocks: int
) -> None:
    """Prompts drawn from a few shared stems, a small cache (evictions, preemptions), chunked
    prefills: every request gets exactly what it gets alone, and the books stay exact."""
    language = HashLanguage(vocab)
    model = MockModel(language) if stateless else CachedMockModel(num_slots, language)  # type: ignore[arg-type]
    stems = data.draw(st.lists(st.lists(st.integers(1, vocab - 1), min_size=0, max_size=10),
                               min_size=1, max_size=3))  # fmt: skip
    seqs = []
    for i in range(data.draw(st.integers(1, 8))):
        stem = data.draw(st.sampled_from(stems))
        tail = data.draw(st.lists(st.integers(1, vocab - 1), min_size=1, max_size=6))
        seqs.append(seq(f"r{i}", stem + tail, data.draw(st.integers(1, 6))))
    budget = max(budget, num_slots)
    config = SchedulerConfig(num_slots, max_num_batched_tokens=budget, block_size=BS,
                             kv_cache_tokens=kv_blocks * BS, max_model_len=22,
                             enable_prefix_caching=True)  # fmt: skip
    scheduler, runner = Scheduler(config), make_runner(model, num_slots)
    for s in seqs:
        scheduler.add(s, 0.0)
    for _ in range(2000):
        if not scheduler.has_work():
            break
        out = scheduler.schedule(0.0)
        scheduler.update(out, runner.execute(out), 0.0)
        running, books, cache = scheduler.slots.running(), scheduler.books, scheduler.prefix_cache
        assert cache is not None
        assert cache.num_referenced == referenced_blocks(scheduler)
        assert books.used(running) + cache.num_free <= books.total
    assert not scheduler.has_work()
    alone = MockModel(language)  # type: ignore[arg-type]
    for s in seqs:
        assert s.generated == run_alone(alone, s.prompt, s.max_tokens, STOP, False)


# --- over the API -----------------------------------------------------------------------------


def counter(text: str, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


async def test_prefix_cache_counters_count_tokens(make_client: ClientFactory) -> None:
    system = "You are a helpful assistant. " * 4  # 116 bytes: 7 full blocks of 16
    async with make_client(enable_prefix_caching=True) as client:
        for question in ("Why?", "How?"):
            body = {"prompt": system + question, "max_tokens": 2, "stream": False}
            r = await client.post("/generate", json=body)
            assert r.status_code == 200
        text = (await client.get("/metrics")).text
    assert counter(text, "vllm:prefix_cache_queries_total") == 2 * 120
    assert counter(text, "vllm:prefix_cache_hits_total") == 7 * 16


async def test_the_same_prompt_gives_the_same_output_with_and_without_the_cache(
    make_client: ClientFactory,
) -> None:
    body = {"prompt": "Tell me a story about a river " * 5, "max_tokens": 40, "stream": False}

    async def twice(client: httpx.AsyncClient) -> list[list[int]]:
        return [(await client.post("/generate", json=body)).json()["tokens"] for _ in range(2)]

    async with make_client(enable_prefix_caching=True) as client:
        with_cache = await twice(client)
    async with make_client() as client:
        without = await twice(client)
    assert with_cache == without and with_cache[0] == with_cache[1]


def test_serve_refuses_the_flag_for_such_a_model_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import app.api.app
    from app.api.app import create_app

    monkeypatch.setattr(app.api.app, "create_app", lambda s: create_app(s, NoPrefixModel()))
    _, settings = parse(["serve", "--enable-prefix-caching"])
    with pytest.raises(SystemExit) as exit_info:
        serve(settings)
    message = str(exit_info.value)
    assert message.startswith("slotserve: error: prefix caching is not implemented")
    assert "\n" not in message
