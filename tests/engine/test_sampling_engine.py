"""Log probabilities, bans and min_tokens through the scheduler, against each request run
alone: whatever shares its batch, chunked prefill, a small KV cache that preempts, the prefix
cache, a request's tokens, log probabilities and prompt log probabilities are the same, and
they stay aligned with its tokens."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from hypothesis import given, settings
from hypothesis import strategies as st

from app.engine.runner import make_runner
from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.types import FinishReason, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import Model, SampledRow, SamplingParams, StepBatch, StepResult

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


# --- the plain model call for a step whose every row samples plainly --------------------------


class RecordingMock(MockModel):
    """Records which token method each call used, and the rows' request ids."""

    def __init__(self) -> None:
        super().__init__(LANGUAGE)
        self.calls: list[tuple[str, int]] = []

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        self.calls.append(("next_tokens", len(batch)))
        return super().next_tokens(batch)

    def next_tokens_for(self, rows: Seq[SampledRow]) -> StepResult:
        self.calls.append(("next_tokens_for", len(rows)))
        return super().next_tokens_for(rows)


def test_a_prompt_chunk_that_samples_nothing_leaves_a_stateless_step_plain() -> None:
    """A request that asks for log probabilities, its prompt fed in chunks: until its last
    chunk it is no row of the model call, so the plain request decoding beside it is served
    by ``next_tokens`` (``next_tokens_for`` only for a step with a row that is not plain)."""
    model = RecordingMock()
    scheduler = Scheduler(SchedulerConfig(2, max_num_batched_tokens=3))
    runner = make_runner(model, 2)
    plain = Sequence("plain", [1], 3, frozenset({STOP}))
    asking = Sequence("asking", [2] * 7, 1, frozenset({STOP}), sampling=SamplingParams(logprobs=1))
    scheduler.add(plain, 0.0)
    scheduler.add(asking, 0.0)
    while scheduler.has_work():
        out = scheduler.schedule(0.0)
        scheduler.update(out, runner.execute(out), 0.0)
    # plain's prefill beside asking's first chunk, then plain's two decodes beside asking's
    # next chunks: one plain row each; then asking's last chunk samples: its own row
    assert model.calls == [("next_tokens", 1)] * 3 + [("next_tokens_for", 1)]
    assert plain.num_generated == 3 and asking.finished


class RecordingCachedModel(CachedMockModel):
    """Records which step method each call used; ``release`` raises for a slot in ``broken``."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, LANGUAGE)
        self.calls: list[str] = []
        self.broken: set[int] = set()

    def release(self, slot: int) -> None:
        if slot in self.broken:
            raise RuntimeError(f"slot {slot} cannot be reset")
        super().release(slot)

    def step(self, batch: StepBatch) -> list[int]:
        self.calls.append("step")
        return super().step(batch)

    def step_sampled(self, batch: StepBatch) -> StepResult:
        self.calls.append("step_sampled")
        return super().step_sampled(batch)


def test_a_chunk_not_run_on_a_slot_that_failed_its_reset_leaves_a_cached_step_plain() -> None:
    """A request asking for log probabilities is given the slot just freed, whose reset fails
    in the step's call: its chunk is not run, so the plain request decoding beside it is the
    only row and the call is ``step``."""
    model = RecordingCachedModel(2)
    scheduler = Scheduler(SchedulerConfig(2))
    runner = make_runner(model, 2)
    short = Sequence("short", [1], 1, frozenset({STOP}))
    long = Sequence("long", [2], 4, frozenset({STOP}))
    scheduler.add(short, 0.0)
    scheduler.add(long, 0.0)
    out = scheduler.schedule(0.0)
    scheduler.update(out, runner.execute(out), 0.0)  # both prefill; short ends by length
    assert short.finished and not long.finished
    asking = Sequence("asking", [3], 2, frozenset({STOP}), sampling=SamplingParams(logprobs=1))
    scheduler.add(asking, 0.0)
    model.broken.add(short_slot := out.prefills[0].slot)
    out = scheduler.schedule(0.0)
    assert out.released == [short_slot] and out.prefills[0].slot == short_slot
    result = runner.execute(out)
    assert result.unavailable_slots == {short_slot}
    assert model.calls == ["step", "step"]
    scheduler.update(out, result, 0.0)
    assert not asking.finished and asking.slot is None  # back in the queue, nothing lost
