"""Rotary position embeddings: one cos/sin table per model, indexed by each token's position."""

from __future__ import annotations

import torch

from app.models.hf.config import ArchConfig


class Rope:
    """Precomputed cos/sin for positions ``0 .. max_positions - 1`` with the checkpoint's
    ``rope_theta`` and scaling. ``apply`` rotates query or key heads in the "rotate half" layout
    Hugging Face checkpoints use (the first and second halves of a head are the pair)."""

    def __init__(
        self, arch: ArchConfig, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        inv_freq, scale = _inverse_frequencies(arch, device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq.to(torch.float64))
        self.cos = (angles.cos() * scale).to(dtype)  # (positions, head_dim / 2)
        self.sin = (angles.sin() * scale).to(dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped (tokens, 1, head_dim / 2) to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` (tokens, heads, head_dim)."""
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _inverse_frequencies(arch: ArchConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    if arch.rope_type == "default":
        exponents = torch.arange(0, arch.head_dim, 2, dtype=torch.float64, device=device)
        return 1.0 / (arch.rope_theta ** (exponents / arch.head_dim)), 1.0
    # Scaled variants (linear, llama3, yarn): the checkpoint's formula as transformers defines it.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[arch.rope_type](arch.hf_config, device)
    return inv_freq, float(scale)
