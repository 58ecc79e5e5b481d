"""The architecture facts our forward pass needs, read from a checkpoint's ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.models.hf.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ArchConfig:
    """One decoder-only checkpoint's shape. ``hf_config`` is the transformers config object (used
    only to compute scaled RoPE frequencies); ``context_limit`` is the longest context the
    checkpoint supports with full attention (its max positions, or its sliding window)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    tie_word_embeddings: bool
    context_limit: int
    hf_config: Any

    @property
    def kv_elements_per_token(self) -> int:
        """KV-cache elements per token (K and V, every layer); multiply by the element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def arch_config(hf_config: Any) -> ArchConfig:
    """Checks that ``hf_config`` describes an architecture our forward pass implements and
    returns its shape. Raises ``ModelLoadError`` naming what is not supported."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not known:
        raise ModelLoadError(
            f"unsupported architecture {archs or '(none in config.json)'}: slotserve serves "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    if getattr(hf_config, "use_sliding_window", False):
        raise ModelLoadError("unsupported: sliding-window attention (use_sliding_window=true)")
    if getattr(hf_config, "mlp_bias", False):
        raise ModelLoadError("unsupported: MLP biases (mlp_bias=true)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported activation {hf_config.hidden_act!r} (only silu)")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = str(rope.get("rope_type", rope.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported RoPE scaling {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise ModelLoadError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 1 << 20)
    window = getattr(hf_config, "sliding_window", None)
    if window:  # full attention over at most the window is exactly sliding-window attention
        limit = min(limit, int(window))
    return ArchConfig(
        architecture=known[0],
        vocab_size=int(hf_config.vocab_size),
        hidden_size=int(hf_config.hidden_size),
        intermediate_size=int(hf_config.intermediate_size),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        rope_type=rope_type,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        context_limit=limit,
        hf_config=hf_config,
    )
