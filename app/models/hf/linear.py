"""``Linear``: ``y = x @ W.T + b`` for the forward's weight matrices, stored one of three ways.

- Full precision. On a CPU in bfloat16, ``F.linear`` hands the weight to oneDNN, which reorders
  it into its blocked layout at every call; here it is reordered once at load (oneDNN's
  prepacked weight, the one torch's inductor uses when it freezes a model) and oneDNN is called
  directly: same kernel, same results bit for bit, without the per-call reorder (measured 12%
  less time per product at 32 rows, 2x less at 1 row). Elsewhere it is ``F.linear``.
- ``int8``: one signed byte per weight and one scale per output row (symmetric), torch's
  ``_weight_int8pack_mm`` CPU kernel.
- ``int4``: 4 bits per weight in groups of 32 along the input, each group with a scale and a
  minimum (asymmetric, like GGUF's Q4_1), torch's ``_weight_int4pack_mm_for_cpu`` kernel.

Quantization is weight-only: activations stay in the model's dtype. It pays where a step is
bound by reading the weights (one or a few rows); docs/benchmarks.md has the accuracy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_GROUP = 32
# Shapes torch's kernels take (a matrix of another shape stays in full precision):
# _weight_int8pack_mm in bfloat16 reads past a row whose input width is not a multiple of 16
# (garbage or a crash, unchecked); _convert_weight_to_int4pack_for_cpu refuses outputs not a
# multiple of 16.
INT8_INPUTS = 16
INT4_OUTPUTS = 16


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

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        quantization: str = "none",
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.kind = quantization
        self.scales: torch.Tensor | None = None
        if quantization == "int8" and self.in_features % INT8_INPUTS == 0:
            self.weight, self.scales = _int8(weight)
        elif (
            quantization == "int4"
            and self.in_features % INT4_GROUP == 0
            and (self.out_features % INT4_OUTPUTS == 0)
        ):
            self.weight, self.scales = _int4(weight)
        elif can_prepack(weight):
            self.kind = "packed"
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        else:
            self.kind = "none"
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return product(self.kind, x, self.weight, self.scales, self.bias)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(weight, scales, bias)`` as ``product`` takes them after ``self.kind``."""
        return self.weight, self.scales, self.bias


def product(
    kind: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W.T + b`` for a ``Linear`` of ``kind`` stored as ``weight`` (and ``scales``): the
    one implementation, called eagerly by ``Linear`` and traced by the compiled forward (where
    the tensors are graph inputs, so one graph serves every layer)."""
    out: torch.Tensor
    if kind == "packed":
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    if kind == "none":
        return F.linear(x, weight, bias)
    if kind == "int8":
        out = torch.ops.aten._weight_int8pack_mm(x, weight, scales)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, INT4_GROUP, scales)
    return out if bias is None else out + bias


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``w ~= q * scale``."""
    wide = weight.float()
    scales = (wide.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = (wide / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales.to(weight.dtype)


def _int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``INT4_GROUP`` inputs: ``w ~= q * scale + minimum``, q in
    0..15. torch's kernel computes ``(q - 8) * scale + zero``, so ``zero = minimum + 8 * scale``;
    scales and zeros go in one tensor shaped (in / group, out, 2)."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q.to(torch.int32).view(out_features, in_features), 1
    )
    scales_zeros = torch.stack([scales, low + 8 * scales], dim=-1).transpose(0, 1)
    return packed, scales_zeros.contiguous().to(weight.dtype)
