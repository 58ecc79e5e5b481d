"""The shape of a transformer from its Hugging Face ``config.json``.

Supported: Llama-style dense decoders (Llama, Mistral, Qwen2, ... : grouped-query attention,
a gated MLP of three matrices) and Mixtral-style mixtures of experts (``num_local_experts``
gated MLPs per layer, ``num_experts_per_tok`` of them per token, a router). Everything the step
time needs is derived here: parameter counts, bytes, FLOPs per token, KV bytes per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app.checks import flag, integer

# Bytes of one weight as vLLM's ``dtype=auto`` serves a checkpoint of that dtype: float32 ones in
# 16 bits (vLLM: "auto" uses 16-bit precision for float32 models).
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 2, "float8": 1, "fp8": 1, "auto": 2}
# Bytes of one K or V element: vLLM's ``kv_cache_dtype=auto`` keeps the KV cache in the model's
# activation dtype (16-bit), fp8 weights or not; fp8 KV needs ``--kv-cache-dtype fp8``.
KV_DTYPE_BYTES = 2


class ModelConfigError(ValueError):
    """A config.json the step time cannot use (names the file and the field)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder-only transformer, as its config.json describes it."""

    name: str
    hidden: int  # d
    layers: int  # L
    heads: int  # H (query heads)
    kv_heads: int
    head_dim: int
    intermediate: int  # d_ff of one (expert) MLP
    vocab: int
    experts: int = 0  # 0: dense
    experts_per_token: int = 0
    dtype_bytes: int = 2  # one weight (1: fp8); the KV cache is 16-bit (KV_DTYPE_BYTES)
    tied_embeddings: bool = False
    max_position: int | None = None  # max_position_embeddings: vLLM's default max_model_len

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def attention_params(self) -> int:
        """One layer's q, k, v and o projections."""
        q = self.heads * self.head_dim
        return self.hidden * (2 * q + 2 * self.kv_heads * self.head_dim)

    @property
    def expert_params(self) -> int:
        """One gated MLP (gate, up, down)."""
        return 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        """One layer in all (every expert, the router)."""
        if not self.moe:
            return self.attention_params + self.expert_params
        return (
            self.attention_params + self.experts * self.expert_params + self.hidden * self.experts
        )

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def active_layer_params(self) -> int:
        """One layer's parameters one token goes through (its experts, not all)."""
        if not self.moe:
            return self.layer_params
        routed = self.experts_per_token * self.expert_params + self.hidden * self.experts
        return self.attention_params + routed

    def kv_bytes_per_token(self, tensor_parallel: int = 1) -> int:
        """K and V of one token, every layer, on one of ``tensor_parallel`` GPUs (a GPU holds
        at least one KV head: vLLM replicates them when there are fewer than GPUs)."""
        heads = max(1, self.kv_heads // tensor_parallel)
        return 2 * self.layers * heads * self.head_dim * KV_DTYPE_BYTES

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """Refuse a tensor-parallel size vLLM refuses: it must divide the attention heads (and
        the KV heads, or be a multiple of them)."""
        if tensor_parallel < 1:
            raise ModelConfigError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel}")
        if self.heads % tensor_parallel:
            raise ModelConfigError(
                f"--tensor-parallel-size {tensor_parallel} does not divide the "
                f"{self.heads} attention heads of {self.name}"
            )
        kv = self.kv_heads
        if kv % tensor_parallel and tensor_parallel % kv:
            raise ModelConfigError(
                f"--tensor-parallel-size {tensor_parallel} neither divides nor is a multiple of "
                f"the {kv} KV heads of {self.name}"
            )


def _field(config: dict[str, Any], name: str, where: str, *aliases: str) -> int:
    """A required positive integer field (or the first of its aliases present)."""
    value = _optional(config, where, name, *aliases)
    if value is None:
        raise ModelConfigError(f"{where}: missing {name!r}, which the step time needs")
    return value


def _optional(config: dict[str, Any], where: str, *keys: str, minimum: int = 1) -> int | None:
    """An optional integer field (the first of ``keys`` present), ``>= minimum``."""
    for key in keys:
        value = config.get(key)
        if value is not None:
            return integer(value, f"{where}: {key}", ModelConfigError, minimum=minimum)
    return None


def _dtype_bytes(config: dict[str, Any], where: str) -> int:
    """Bytes of one weight as vLLM serves it (``dtype=auto``): 16-bit for float16, bfloat16
    and float32 checkpoints alike (vLLM serves float32 in 16 bits), 1 for fp8."""
    key = "torch_dtype" if config.get("torch_dtype") is not None else "dtype"
    dtype = config.get(key)
    if dtype is None:
        dtype = "bfloat16"
    if not isinstance(dtype, str):
        raise ModelConfigError(f"{where}: {key} must be a string, got {dtype!r}")
    name = dtype.lower().removeprefix("torch.")
    size = DTYPE_BYTES.get(name)
    if size is None:
        raise ModelConfigError(f"{where}: {key} {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ModelConfigError(f"{where}: quantization_config must be an object, got {quant!r}")
    if quant is not None and str(quant.get("quant_method", "")).lower() == "fp8":
        size = 1  # fp8 weights (and vLLM's fp8 GEMMs)
    return size


def shape_from_config(config: dict[str, Any], where: str = "config.json") -> ModelShape:
    """The ``ModelShape`` of a parsed config.json; ``ModelConfigError`` names a missing or bad
    field (a wrong type, a size below 1, heads the KV heads do not divide, more experts per
    token than experts). ``text_config`` (multimodal wrappers) is read when the top level has
    no layers."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    hidden = _field(config, "hidden_size", where, "n_embd", "d_model")
    heads = _field(config, "num_attention_heads", where, "n_head")
    kv_heads = _optional(config, where, "num_key_value_heads") or heads
    if kv_heads > heads or heads % kv_heads:
        raise ModelConfigError(
            f"{where}: num_key_value_heads {kv_heads} must divide num_attention_heads {heads}"
        )
    head_dim = _optional(config, where, "head_dim") or hidden // heads
    if head_dim < 1:
        raise ModelConfigError(
            f"{where}: hidden_size {hidden} is smaller than num_attention_heads {heads} "
            "(a head of 0 dimensions) and there is no head_dim"
        )
    experts = _optional(config, where, "num_local_experts", "num_experts", minimum=0) or 0
    per_token = _optional(config, where, "num_experts_per_tok", minimum=0) or 0
    if experts and not per_token:
        raise ModelConfigError(f"{where}: missing 'num_experts_per_tok' of a mixture of experts")
    if per_token > experts and experts:
        raise ModelConfigError(
            f"{where}: num_experts_per_tok {per_token} exceeds the {experts} experts"
        )
    intermediate_key = (
        "moe_intermediate_size"
        if experts and "moe_intermediate_size" in config
        else "intermediate_size"
    )
    tied = config.get("tie_word_embeddings", False)
    tied = flag(tied, f"{where}: tie_word_embeddings", ModelConfigError)
    name = config.get("_name_or_path") or config.get("model_type")
    return ModelShape(
        name=str(name) if isinstance(name, str) and name else where,
        hidden=hidden,
        layers=_field(config, "num_hidden_layers", where, "n_layer"),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=_field(config, intermediate_key, where, "ffn_dim"),
        vocab=_field(config, "vocab_size", where),
        experts=experts,
        experts_per_token=per_token if experts else 0,
        dtype_bytes=_dtype_bytes(config, where),
        tied_embeddings=tied,
        max_position=_optional(config, where, "max_position_embeddings"),
    )


def load_model_config(path: str | Path) -> ModelShape:
    """Read a config.json (or a model folder holding one), or a known model's shape by name
    (``app.step_time.known_models``)."""
    from app.step_time.known_models import KNOWN_MODELS

    name = str(path)
    if name.lower() in KNOWN_MODELS and not Path(path).exists():
        return replace(shape_from_config(KNOWN_MODELS[name.lower()], name), name=name.lower())
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        known = ", ".join(KNOWN_MODELS)
        raise ModelConfigError(
            f"cannot read --model-config {path}: {exc.strerror} (a config.json, or one of: {known})"
        ) from exc
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"--model-config {path} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelConfigError(f"--model-config {path} is not a JSON object")
    shape = shape_from_config(config, str(path))
    if "_name_or_path" not in config:
        shape = replace(shape, name=path.parent.name if path.name == "config.json" else path.stem)
    return shape
