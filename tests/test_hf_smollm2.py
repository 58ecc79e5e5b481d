"""SmolLM2-135M-Instruct itself, through our forward pass, converted from its GGUF."""

from __future__ import annotations

import pytest
from hf_smollm2 import smollm2_cache_dir

from app.models.hf import load_model
from app.models.hf.weights import COMPLETE_MARKER
from app.models.protocol import GREEDY, PrefillChunk, StepBatch


def test_smollm2_answers_the_capital_of_france_greedily() -> None:
    cache_dir = smollm2_cache_dir()
    (converted,) = [p for p in cache_dir.iterdir() if not p.name.startswith(".")]
    assert (converted / COMPLETE_MARKER).is_file()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in converted.iterdir()
    }
    loaded = load_model(
        "smollm2", num_slots=2, max_model_len=512, kv_cache_memory=1 << 30, cache_dir=cache_dir
    )
    assert [p for p in cache_dir.iterdir() if not p.name.startswith(".")] == [converted]
    assert (loaded.name, loaded.max_model_len, loaded.kv_capacity_tokens) == (
        "SmolLM2-135M-Instruct",
        512,
        1024,
    )
    # 30 layers x K and V x 3 KV heads x 64 x 4 bytes per token, 46 KB
    assert loaded.kv_cache_bytes == 1024 * 30 * 2 * 3 * 64 * 4
    tok, model = loaded.tokenizer, loaded.model
    prompt = tok.chat_prompt([("user", "What is the capital of France?")])
    out = model.step(StepBatch([], [], [], [], [PrefillChunk(1, prompt, 0, True, GREEDY, "q")]))
    while out[-1] not in tok.stop_token_ids and len(out) < 20:
        out += model.step(StepBatch([1], [out[-1]], [GREEDY], ["q"], []))
    assert out[-1] == tok.eos_token_id == 2
    assert "Paris" in tok.decode(out)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_smollm2_loads_in_a_narrower_dtype(dtype: str) -> None:
    loaded = load_model(
        "smollm2",
        dtype=dtype,
        num_slots=1,
        max_model_len=64,
        kv_cache_memory=1 << 30,
        cache_dir=smollm2_cache_dir(),
    )
    assert loaded.kv_cache_bytes == 64 * 30 * 2 * 3 * 64 * 2
    assert loaded.model.cache.keys.dtype.itemsize == 2
