"""``Linear``: ``y = x @ W.T + b`` for the forward's weight matrices.

On a CPU in bfloat16, ``F.linear`` hands the weight to oneDNN, which reorders it into its
blocked layout at every call; ``Linear`` reorders it once at load (oneDNN's prepacked weight,
the one torch's own inductor uses when it freezes a model) and calls oneDNN directly. Same
kernel, same results bit for bit, without the per-call reorder: measured here 12% less time per
product at 32 rows and 2x less at 1 row (docs/benchmarks.md, "Forward"). Elsewhere (float32,
CUDA, no oneDNN) it is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` gets oneDNN's prepacked layout: bfloat16 on a CPU with oneDNN bf16."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class Linear:
    """A weight (out, in) and an optional bias (out,), applied to ``x`` (tokens, in)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = can_prepack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 32) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.weight, self.bias, "none", [], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)
