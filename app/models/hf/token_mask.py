"""The grammar stage of the real model's sampling pipeline (structured outputs): each
constrained row's forbidden tokens get -inf before sampling, in one vectorized pass over the
rows that have a mask. A step with no mask pays one check."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_masks(logits: torch.Tensor, masks: Sequence[bytes | None]) -> torch.Tensor:
    """``logits`` (rows, vocab), with row i's tokens whose bit is clear in ``masks[i]`` (bit t =
    byte t // 8, bit t % 8; tokens past the mask are forbidden) set to -inf, in place. Rows
    whose mask is None are left alone. Returns ``logits``."""
    rows = [i for i, mask in enumerate(masks) if mask is not None]
    if not rows:
        return logits
    packed = b"".join(mask for mask in masks if mask is not None)
    width = len(packed) // len(rows)
    device, vocab = logits.device, logits.shape[-1]
    bytes_ = torch.frombuffer(bytearray(packed), dtype=torch.uint8).view(len(rows), width)
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    bits = (bytes_.to(device).unsqueeze(-1) >> shifts) & 1  # (rows, width, 8)
    allowed = bits.view(len(rows), width * 8).bool()
    if width * 8 < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - width * 8), value=False)
    index = torch.tensor(rows, device=device)
    selected = logits.index_select(0, index)
    selected.masked_fill_(~allowed[:, :vocab], float("-inf"))
    logits.index_copy_(0, index, selected)
    return logits
