"""Token choice for one step, vectorized over rows: greedy rows take the argmax; the rows that
sample go through ONE batched path (temperature, min-p, top-k, top-p, then a draw), so a step
costs a fixed handful of tensor ops whatever its number of sampled rows.

The draw is inverse-CDF sampling: each sampled row gets one uniform number ``u`` in [0, 1) and
takes the first token whose cumulative probability exceeds ``u`` times the row's total. A
request with a ``seed`` gets, for the token at position ``p``, ``u`` computed from (seed, p)
alone (a SplitMix64 hash), so its draw depends on nothing else in its batch, and a request
preempted and re-prefilled later continues exactly as if it had never been interrupted (every
per-row operation here computes a row the same way whatever the other rows are), given the
same logits: in float32 the forward gives them; in bfloat16 its attention rounds differently
with the batch's key padding and between prefill and decode (README, "real model"). Requests
without a seed share one torch generator seeded randomly at start.

Why not one ``torch.multinomial`` per row (the first implementation): on CPU each call runs
several small OpenMP parallel regions over the 49,152-entry vocabulary; with 32 rows that is
hundreds of regions per step, each ending in a barrier. On 2 cores shared with the event loop,
every barrier waits for a worker thread that the event loop has just descheduled, and a 32-row
step went from ~0.1 s to ~3 s (see docs/benchmarks.md, "Sampled load").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.models.protocol import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over the seed space
_MASK64 = (1 << 64) - 1
_SEED_MASK = (1 << 63) - 1
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing the
# logits by a float32 temperature near 0 overflows to inf, and the draw would return no token


def seed_for(seed: int, position: int) -> int:
    """The 63-bit key of a seeded request's token at ``position``."""
    return (seed * _MIX + position) & _SEED_MASK


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that a seeded request's draw at ``position`` uses: the
    SplitMix64 finalizer of ``seed_for(seed, position)``, top 53 bits."""
    z = (seed_for(seed, position) + _MIX) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


class Sampler:
    """Chooses one token per row of float32 logits (rows, vocab)."""

    def __init__(self, default_temperature: float, device: torch.device) -> None:
        self.default_temperature = default_temperature
        self.device = device
        self._shared = torch.Generator(device="cpu")
        self._shared.seed()

    def temperature(self, p: SamplingParams) -> float:
        """The temperature ``p`` samples at (its own, else the model's default); 0 (greedy)
        below ``GREEDY_BELOW``."""
        t = self.default_temperature if p.temperature is None else p.temperature
        return t if t >= GREEDY_BELOW else 0.0

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
    ) -> list[int]:
        """``params[i]`` and ``positions[i]`` (the position the sampled token will take) belong to
        row ``i``. Greedy rows (temperature 0, or below ``GREEDY_BELOW``) take their argmax; the
        others are drawn in one batch (``draw``)."""
        rows = [i for i, p in enumerate(params) if self.temperature(p) > 0]
        if len(rows) == len(params):  # every row samples: no copy, no argmax
            return draw(logits, params, self._uniforms(params, positions), self.default_temperature)
        chosen = [int(t) for t in logits.argmax(dim=-1).tolist()]
        if rows:
            drawn = self.sample(  # the sampling rows alone: every one samples
                logits.index_select(0, torch.tensor(rows, device=logits.device)),
                [params[i] for i in rows],
                [positions[i] for i in rows],
            )
            for i, token in zip(rows, drawn, strict=True):
                chosen[i] = token
        return chosen

    def _uniforms(self, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[float]:
        """One uniform per row: from (seed, position) for seeded rows, else from the shared
        generator (drawn in one call for all unseeded rows)."""
        unseeded = sum(1 for p in params if p.seed is None)
        shared = (
            torch.rand(unseeded, generator=self._shared, dtype=torch.float64).tolist()
            if unseeded
            else []
        )
        out = []
        for p, position in zip(params, positions, strict=True):
            out.append(shared.pop() if p.seed is None else seeded_uniform(p.seed, position))
        return out


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: Sequence[float],
    default_temperature: float,
) -> list[int]:
    """One token per row of ``logits`` (rows, vocab), every row sampling (temperature > 0),
    ``uniforms[i]`` in [0, 1) being row ``i``'s random number: the first token whose
    cumulative (filtered) probability exceeds ``uniforms[i]`` times the row's total."""
    device = logits.device
    temps = [default_temperature if p.temperature is None else p.temperature for p in params]
    probs = torch.softmax(logits / torch.tensor(temps, device=device)[:, None], dim=-1)
    cdf = filtered(probs, params).cumsum(dim=-1)  # accumulated in double by torch's CPU kernel
    total = cdf[:, -1:]
    targets = torch.tensor(uniforms, dtype=cdf.dtype, device=device)[:, None] * total
    # u * total may round up to the total: the largest float below it still picks a token
    # whose probability is above 0 (the first where the cdf rises past the target).
    targets = torch.minimum(targets, torch.nextafter(total, torch.zeros_like(total)))
    chosen = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return [int(t) for t in chosen.tolist()]


def filtered(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``probs`` (rows, vocab) with, per row, the tokens that min-p, top-k and top-p drop set
    to 0 (not renormalized: the draw scales by the row's total), in that order (vLLM's: min-p
    on the tempered distribution, then top-k, then top-p). A filter runs only when some row
    uses it, and leaves the rows that do not use it unchanged."""
    device, dtype, vocab = probs.device, probs.dtype, probs.shape[-1]
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=dtype)
        floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = probs.topk(max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None])
        off = torch.tensor([k == 0 for k in ks], device=device)[:, None]
        probs = probs.masked_fill((probs < kth) & ~off, 0.0)
    if any(p.top_p < 1.0 for p in params):
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        bound = torch.tensor(top_p, device=device, dtype=dtype)[:, None]
        drop = before >= bound * sorted_probs.sum(dim=-1, keepdim=True)
        drop[:, 0] = False  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs
