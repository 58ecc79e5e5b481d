"""Named model shapes: ``--model-config llama-3.1-8b`` instead of a config.json path.

The fields the step time reads, as the models' published Hugging Face config.json files state
them (``max_position_embeddings`` is the context vLLM defaults to).
"""

from __future__ import annotations

from typing import Any


def _llama(hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, ctx: int,
           **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": ffn, "vocab_size": vocab,
            "max_position_embeddings": ctx, "torch_dtype": "bfloat16", **extra}  # fmt: skip


KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008, 32000, 4096),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824, 32000, 4096),
    "llama-2-70b": _llama(8192, 80, 64, 8, 28672, 32000, 4096),
    "codellama-34b": _llama(8192, 48, 64, 8, 22016, 32000, 16384),
    "llama-3.1-8b": _llama(4096, 32, 32, 8, 14336, 128256, 131072),
    "llama-3.1-70b": _llama(8192, 80, 64, 8, 28672, 128256, 131072),
    "mistral-7b": _llama(4096, 32, 32, 8, 14336, 32000, 32768),
    "mixtral-8x7b": _llama(
        4096, 32, 32, 8, 14336, 32000, 32768, num_local_experts=8, num_experts_per_tok=2
    ),
    "qwen2.5-7b": _llama(3584, 28, 28, 4, 18944, 152064, 32768),
}
