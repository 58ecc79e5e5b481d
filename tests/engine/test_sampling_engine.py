"""Log probabilities, bans and min_tokens through the scheduler, against each request run
alone: whatever shares its batch, chunked prefill, a small KV cache that preempts, the prefix
cache, a request's tokens, log probabilities and prompt log probabilities are the same, and
they stay aligned with its tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from app.engine.runner import make_runner
from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.types import FinishReason, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import Model, SamplingParams

STOP = 256
LANGUAGE = MockLanguage(stop_probability=0.2)

sampling = st.builds(
    SamplingParams,
    logprobs=st.none() | st.integers(0, 3),
    prompt_logprobs=st.none() | st.integers(0, 2),
    min_tokens=st.integers(0, 6),
    logit_bias=st.lists(
        st.tuples(st.sampled_from([ord(c) for c in "aeiou "]), st.just(-100.0)), max_size=2
    ).map(tuple),
)
requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, 255), min_size=1, max_size=40),
        st.integers(0, 12),
        sampling,
    ),
    min_size=1,
    max_size=6,
)


def run(
    specs: list[tuple[list[int], int, SamplingParams]], model: Model, config: SchedulerConfig
) -> dict[str, Sequence]:
    scheduler = Scheduler(config)
    runner = make_runner(model, config.num_slots)
    seqs = {}
    for i, (prompt, max_tokens, params) in enumerate(specs):
        seq = Sequence(f"r{i}", list(prompt), max_tokens, frozenset({STOP}), sampling=params)
        seqs[seq.request_id] = seq
        scheduler.add(seq, 0.0)
    for _ in range(10_000):
        if not scheduler.has_work():
            break
        out = scheduler.schedule(0.0)
        if not out.empty:
            scheduler.update(out, runner.execute(out), 0.0)
    assert not scheduler.has_work()
    runner.close()
    return seqs


@settings(max_examples=60, deadline=None)
@given(
    specs=requests,
    cached=st.booleans(),
    num_slots=st.integers(1, 4),
    budget=st.integers(4, 64),
    kv_blocks=st.integers(8, 40),
    prefix=st.booleans(),
)
def test_logprobs_bans_and_min_tokens_do_not_depend_on_the_batch(
    specs: list[tuple[list[int], int, SamplingParams]],
    cached: bool,
    num_slots: int,
    budget: int,
    kv_blocks: int,
    prefix: bool,
) -> None:
    def model(slots: int) -> Model:
        return CachedMockModel(slots, LANGUAGE) if cached else MockModel(LANGUAGE)

    config = SchedulerConfig(
        num_slots, max_num_batched_tokens=max(budget, num_slots), block_size=4,
        kv_cache_tokens=4 * kv_blocks, max_model_len=60, enable_prefix_caching=prefix and cached,
    )  # fmt: skip
    together = run(specs, model(num_slots), config)
    for i, spec in enumerate(specs):
        alone = run([spec], model(1), SchedulerConfig(1))["r0"]
        seq = together[f"r{i}"]
        if seq.finish_reason is FinishReason.ERROR:  # too long for this KV cache: never ran
            assert not seq.generated
            continue
        assert seq.generated == alone.generated, seq.request_id
        assert seq.logprobs == alone.logprobs
        assert seq.prompt_logprobs == alone.prompt_logprobs
        params = spec[2]
        banned = {token for token, _ in params.logit_bias}
        assert not banned & set(seq.generated)
        assert seq.num_generated >= min(params.min_tokens, spec[1])
        if seq.logprobs is not None:
            assert [entry.token for entry in seq.logprobs if entry] == seq.generated
        if seq.prompt_logprobs is not None:
            assert len(seq.prompt_logprobs) == seq.prompt_len
            assert [e.token for e in seq.prompt_logprobs[1:] if e] == seq.prompt[1:]
