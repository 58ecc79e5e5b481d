"""Our forward pass for Llama-family decoders (Llama, Mistral, Qwen2): pre-norm blocks of
grouped-query attention with rotary positions and a SwiGLU MLP, RMSNorm computed in at least
float32, optional q/k/v (and output) biases, tied or separate output embeddings.

The checkpoint's tensors are taken as they are stored (Hugging Face names); q/k/v and gate/up
projections are fused into one matrix each so a layer runs three matrix products for its MLP and
attention inputs instead of five; each is a ``Linear`` (oneDNN's prepacked weight in bfloat16
on CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.models.hf.attention import StepLayout, attend
from app.models.hf.config import ArchConfig
from app.models.hf.errors import ModelLoadError
from app.models.hf.kv_cache import KVCache
from app.models.hf.linear import Linear
from app.models.hf.rope import Rope


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    out: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Linear


def build_weights(
    state: dict[str, torch.Tensor],
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
) -> Weights:
    """Our weight layout from a checkpoint's state dict (Hugging Face names), the matrices
    quantized as ``quantization`` says (``Linear``; the embedding table stays in ``dtype``).
    Raises ``ModelLoadError`` naming the first missing tensor."""

    def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return Linear(weight, bias, quantization)

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelLoadError(f"checkpoint has no tensor {name!r}")
        return state.pop(name).to(device=device, dtype=dtype)

    def maybe(name: str) -> torch.Tensor | None:
        return take(name) if name in state else None

    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        q, k, v = (take(f"{p}self_attn.{n}_proj.weight") for n in "qkv")
        biases = [maybe(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
        qkv_bias = None
        if any(b is not None for b in biases):  # a missing one is zeros
            pairs = zip(biases, (q, k, v), strict=True)
            qkv_bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b for b, w in pairs])
        gate, up = take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")
        layers.append(
            LayerWeights(
                input_norm=take(f"{p}input_layernorm.weight"),
                qkv=linear(torch.cat((q, k, v)), qkv_bias),
                out=linear(take(f"{p}self_attn.o_proj.weight"), maybe(f"{p}self_attn.o_proj.bias")),
                post_norm=take(f"{p}post_attention_layernorm.weight"),
                gate_up=linear(torch.cat((gate, up))),
                down=linear(take(f"{p}mlp.down_proj.weight")),
            )
        )
    embed = take("model.embed_tokens.weight")
    head = maybe("lm_head.weight")
    if head is None and not arch.tie_word_embeddings:
        raise ModelLoadError("checkpoint has no tensor 'lm_head.weight'")
    norm = take("model.norm.weight")
    return Weights(embed, layers, norm, linear(embed if head is None else head))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (or wider), the result cast back and then scaled."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class LlamaForward:
    """Runs the decoder over one step's packed tokens, writing their keys and values into the
    cache, and returns the logits (float32) of the rows asked for."""

    def __init__(self, arch: ArchConfig, weights: Weights, rope: Rope, cache: KVCache) -> None:
        self.arch = arch
        self.weights = weights
        self.rope = rope
        self.cache = cache

    def __call__(
        self, tokens: torch.Tensor, layout: StepLayout, logit_rows: torch.Tensor
    ) -> torch.Tensor:
        w = self.weights
        cos, sin = self.rope.tables(layout.positions)
        hidden = w.embed[tokens]
        for index, layer in enumerate(w.layers):
            hidden = self._layer(index, layer, hidden, layout, cos, sin)
        last = rms_norm(hidden[logit_rows], w.norm, self.arch.rms_norm_eps)
        return w.lm_head(last).float()

    def _layer(
        self,
        index: int,
        layer: LayerWeights,
        hidden: torch.Tensor,
        layout: StepLayout,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Decoder layer ``index`` over the step's hidden states (the compiled forward runs
        the same ``block`` through torch.compile)."""

        def linear(name: str, x: torch.Tensor) -> torch.Tensor:
            product: Linear = getattr(layer, name)
            return product(x)

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return write_and_attend(self.cache, index, q, k, v, layout)

        return block(
            self.arch, layer.input_norm, layer.post_norm, hidden, cos, sin, linear, attention
        )


Product = Callable[[str, torch.Tensor], torch.Tensor]  # a layer's matrix by name, applied
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def block(
    arch: ArchConfig,
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    linear: Product,
    attention: Attention,
) -> torch.Tensor:
    """One pre-norm decoder layer: ``linear(name, x)`` applies the layer's ``qkv``, ``out``,
    ``gate_up`` or ``down`` matrix; ``attention(q, k, v)`` stores k and v in the cache and
    returns (tokens, heads * head_dim)."""
    kv_width = arch.num_kv_heads * arch.head_dim
    x = rms_norm(hidden, input_norm, arch.rms_norm_eps)
    qk, v = torch.split(linear("qkv", x), [arch.num_heads * arch.head_dim + kv_width, kv_width], -1)
    # queries and keys rotate together: one RoPE over (tokens, heads + kv_heads, head_dim)
    qk = Rope.apply(qk.view(-1, arch.num_heads + arch.num_kv_heads, arch.head_dim), cos, sin)
    q, k = torch.split(qk, [arch.num_heads, arch.num_kv_heads], dim=1)
    hidden = hidden + linear("out", attention(q, k, v.view_as(k)))
    x = rms_norm(hidden, post_norm, arch.rms_norm_eps)
    gate, up = linear("gate_up", x).chunk(2, dim=-1)
    return hidden + linear("down", F.silu(gate) * up)


def write_and_attend(
    cache: KVCache,
    index: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: StepLayout,
) -> torch.Tensor:
    """Writes layer ``index``'s keys and values of the step's tokens into the cache (in
    place), then attends (``attention.attend``); returns (tokens, heads * head_dim)."""
    cache.write(index, layout.slots, layout.positions, k, v)
    return attend(cache, index, q, layout)
