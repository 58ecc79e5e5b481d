"""The KV cache: one tensor for keys and one for values, allocated once at start for every
layer, slot and position, and never reallocated. A slot's length says how many of its positions
hold keys and values; releasing a slot sets it to 0 (stale entries past the length are never
read: attention masks them)."""

from __future__ import annotations

import torch

from app.models.hf.config import ArchConfig
from app.models.hf.errors import ModelLoadError


def slot_context(
    arch: ArchConfig, *, num_slots: int, max_model_len: int, budget_bytes: int, dtype: torch.dtype
) -> int:
    """Positions per slot: as many as ``budget_bytes`` holds for ``num_slots`` slots, capped by
    ``max_model_len`` and by the checkpoint's own limit. Raises ``ModelLoadError`` when the budget
    cannot hold even a short context per slot."""
    per_token = arch.kv_elements_per_token * torch.tensor([], dtype=dtype).element_size()
    fits = budget_bytes // (num_slots * per_token)
    context = min(max_model_len, arch.context_limit, fits)
    if context < 16:
        raise ModelLoadError(
            f"--kv-cache-memory {budget_bytes} bytes holds {budget_bytes // per_token} tokens "
            f"({per_token} bytes each), under 16 per slot for {num_slots} slots: raise "
            "--kv-cache-memory or lower --num-slots"
        )
    return context


class KVCache:
    """Keys and values shaped (layers, slots, kv_heads, context, head_dim); ``lengths[slot]`` is
    the number of positions cached for the slot."""

    def __init__(
        self,
        arch: ArchConfig,
        *,
        num_slots: int,
        context: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (arch.num_layers, num_slots, arch.num_kv_heads, context, arch.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.context = context
        self.lengths = [0] * num_slots

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots * self.context

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Stores one layer's keys and values (tokens, kv_heads, head_dim) of tokens at
        ``positions`` in ``slots`` (both shaped (tokens,))."""
        self.keys[layer][slots, :, positions] = keys
        self.values[layer][slots, :, positions] = values

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Give slot ``target`` a copy of slot ``source``'s first ``length`` positions (a fork:
        another choice of the same prompt); ``target``'s length becomes ``length``."""
        if self.lengths[source] < length:
            raise ValueError(
                f"slot {source} caches {self.lengths[source]} positions, not the {length} "
                f"to copy into slot {target}"
            )
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]
        self.lengths[target] = length
