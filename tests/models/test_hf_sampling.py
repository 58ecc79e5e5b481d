"""The batched sampler against a plain per-row reference: filters (min-p, top-k, top-p), the
inverse-CDF draw, batch independence of every row, and the seeded guarantee."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from app.api.schemas import SamplingFields  # noqa: E402
from app.models.hf.sampling import Sampler, draw, filtered, seeded_uniform  # noqa: E402
from app.models.protocol import SamplingParams  # noqa: E402

VOCAB = 24


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """One row, plainly: tempered softmax, then min-p, top-k, top-p (unnormalized)."""
    t = 1.0 if p.temperature is None else p.temperature
    top = max(x / t for x in logits)
    weights = [math.exp(x / t - top) for x in logits]
    probs = [w / sum(weights) for w in weights]
    if p.min_p > 0:
        floor = max(probs) * p.min_p
        probs = [q if q >= floor else 0.0 for q in probs]
    if 0 < p.top_k < len(probs):
        kth = sorted(probs, reverse=True)[p.top_k - 1]
        probs = [q if q >= kth else 0.0 for q in probs]
    if p.top_p < 1.0:
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        total, before, kept = sum(probs), 0.0, [0.0] * len(probs)
        for rank, i in enumerate(order):
            if rank == 0 or before < p.top_p * total:
                kept[i] = probs[i]
            before += probs[i]
        probs = kept
    return probs


def reference_draw(probs: list[float], u: float) -> int:
    target, running = u * sum(probs), 0.0
    for i, q in enumerate(probs):
        running += q
        if running > target and q > 0:
            return i
    return max(i for i, q in enumerate(probs) if q > 0)


params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1]),
    top_k=st.sampled_from([0, 1, 3, 10, VOCAB, VOCAB + 5]),
    seed=st.none() | st.integers(0, 2**40),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)
# Distinct logits on a grid (ties would make the kept set depend on the sort's tie order).
row_st = st.permutations([0.37 * i - 4.0 for i in range(VOCAB)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(row_st, params_st, st.floats(0, 0.999)), min_size=1, max_size=6))
def test_filters_and_draw_match_a_per_row_reference(
    rows: list[tuple[list[float], SamplingParams, float]],
) -> None:
    logits = torch.tensor([r[0] for r in rows])
    params = [r[1] for r in rows]
    uniforms = [r[2] for r in rows]
    tempered = torch.softmax(logits / torch.tensor([p.temperature for p in params])[:, None], -1)
    got = filtered(tempered, params)
    tokens = draw(logits, params, uniforms, 1.0)
    for i, (row, p, u) in enumerate(rows):
        want = reference_probs(row, p)
        kept = [q > 0 for q in want]
        assert [q > 0 for q in got[i].tolist()] == kept
        assert torch.allclose(got[i], torch.tensor(want), atol=1e-6)
        assert kept[tokens[i]]
        # the same row drawn alone: the same token (no dependence on the batch)
        assert draw(logits[i : i + 1], [p], [u], 1.0) == [tokens[i]]
        cdf = [sum(want[: j + 1]) for j in range(VOCAB)]
        if all(abs(u * cdf[-1] - c) > 1e-4 for c in cdf):  # not within rounding of a boundary
            assert tokens[i] == reference_draw(want, u)


def test_the_draw_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf, math.log(6.0)]])
    counts = [0, 0, 0, 0]
    n = 2000
    for k in range(n):
        counts[draw(logits, [SamplingParams(temperature=1.0)], [(k + 0.5) / n], 1.0)[0]] += 1
    assert counts == [200, 600, 0, 1200]  # evenly spaced uniforms: exact shares


def test_seeded_rows_do_not_depend_on_their_batch_and_greedy_rows_take_the_argmax() -> None:
    sampler = Sampler(1.0, torch.device("cpu"))
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1)) * 2
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42)
    free, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
    batch = [free, seeded, greedy, free, seeded, greedy]
    positions = [5, 7, 9, 11, 13, 15]
    tokens = sampler.sample(logits, batch, positions)
    for row in (1, 4):
        alone = sampler.sample(logits[row : row + 1], [seeded], [positions[row]])
        assert alone == [tokens[row]]
    assert tokens[2] == int(logits[2].argmax()) and tokens[5] == int(logits[5].argmax())
    assert sampler.sample(logits, [greedy] * 6, positions) == logits.argmax(-1).tolist()


def test_seeded_uniforms_are_uniform_and_fixed() -> None:
    values = [seeded_uniform(7, p) for p in range(4000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.02
    assert seeded_uniform(7, 3) == values[3] and seeded_uniform(8, 3) != values[3]


def test_min_p_reaches_sampling_params() -> None:
    assert SamplingFields(min_p=0.1).sampling().min_p == 0.1
    assert SamplingFields().sampling().min_p == 0.0
    with pytest.raises(ValueError, match="min_p"):
        SamplingFields(min_p=1.5)


def test_a_tiny_temperature_is_greedy_never_an_out_of_range_token() -> None:
    """Review (issue 19): temperature 1e-40 (the API accepts any value >= 0) divided the logits
    into inf and drew id == vocab size. Below 1e-5 a row is greedy, as in vLLM."""
    sampler = Sampler(1.0, torch.device("cpu"))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)) * 3
    for t in (1e-6, 1e-40, 1e-300, 5e-324):
        rows = [SamplingParams(temperature=t), SamplingParams(temperature=t, seed=3, top_p=0.5)]
        rows.append(SamplingParams(temperature=1.0, seed=4))
        tokens = sampler.sample(logits, rows, [5, 6, 7])
        assert tokens[:2] == logits[:2].argmax(-1).tolist(), t
        assert 0 <= tokens[2] < 50
