"""Per-row token choice: greedy at temperature 0, else temperature, top-k, top-p and a draw.

A request with a ``seed`` draws the token at position ``p`` from a generator seeded with
(seed, p) only, so its tokens depend on nothing else in its batch, and a request preempted and
re-prefilled later continues exactly as if it had never been interrupted. Requests without a
seed share one generator seeded randomly at start.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.models.protocol import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over the seed space
_SEED_MASK = (1 << 63) - 1


def seed_for(seed: int, position: int) -> int:
    """The generator seed of a seeded request's token at ``position``."""
    return (seed * _MIX + position) & _SEED_MASK


class Sampler:
    """Chooses one token per row of float32 logits (rows, vocab)."""

    def __init__(self, default_temperature: float, device: torch.device) -> None:
        self.default_temperature = default_temperature
        self._seeded = torch.Generator(device=device)
        self._shared = torch.Generator(device=device)
        self._shared.seed()

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
    ) -> list[int]:
        """``params[i]`` and ``positions[i]`` (the position the sampled token will take) belong to
        row ``i``."""
        chosen = logits.argmax(dim=-1).tolist()
        for row, p in enumerate(params):
            temperature = self.default_temperature if p.temperature is None else p.temperature
            if temperature > 0:
                chosen[row] = self._draw(logits[row], temperature, p, positions[row])
        return [int(t) for t in chosen]

    def _draw(self, row: torch.Tensor, temperature: float, p: SamplingParams, position: int) -> int:
        probs = filtered_probs(row / temperature, p.top_k, p.top_p)
        generator = self._shared
        if p.seed is not None:
            generator = self._seeded
            generator.manual_seed(seed_for(p.seed, position))
        return int(torch.multinomial(probs, 1, generator=generator))


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities of one row after keeping its ``top_k`` highest logits (0: all) and then the
    smallest set of most likely tokens whose probability reaches ``top_p`` (1.0: all)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        drop = before >= top_p
        drop[0] = False  # the most likely token always stays
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs
