"""SmolLM2-135M-Instruct itself, through our forward pass, converted from its GGUF."""

from __future__ import annotations

from typing import Any

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
        "smollm2",
        dtype="float32",
        num_slots=2,
        max_model_len=512,
        kv_cache_memory=1 << 30,
        cache_dir=cache_dir,
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


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three fruits.",
    "Why is the sky blue?",
    "Give me a tip for learning Python.",
    "What is 12 times 7?",
    "Describe a cat in one sentence.",
]


def greedy_with_logits(dtype: str, new: int) -> tuple[list[list[int]], list[list[Any]]]:
    """Greedy continuations of QUESTIONS (one slot each, one batch) and each step's logits."""
    loaded = load_model(
        "smollm2",
        dtype=dtype,
        num_slots=len(QUESTIONS),
        max_model_len=128,
        kv_cache_memory=1 << 28,
        cache_dir=smollm2_cache_dir(),
    )
    tok, model = loaded.tokenizer, loaded.model
    chunks = [
        PrefillChunk(i, tok.chat_prompt([("user", q)]), 0, True, GREEDY, f"r{i}")
        for i, q in enumerate(QUESTIONS)
    ]
    logits = model.step_logits(StepBatch([], [], [], [], chunks))
    steps = [logits]
    outs = [[t] for t in logits.argmax(-1).tolist()]
    slots = list(range(len(QUESTIONS)))
    for _ in range(new - 1):
        batch = StepBatch(slots, [o[-1] for o in outs], [GREEDY] * len(slots), [""] * 8, [])
        logits = model.step_logits(batch)
        steps.append(logits)
        for out, token in zip(outs, logits.argmax(-1).tolist(), strict=True):
            out.append(token)
    return outs, [[step[i] for step in steps] for i in slots]


def test_bfloat16_greedy_follows_float32_until_a_near_tie() -> None:
    """bfloat16 keeps 8 bits of mantissa: logits move by a few hundredths, so greedy output
    matches float32's until float32 itself had two candidates that close; from there the
    continuations differ (docs/benchmarks.md, "bfloat16 vs float32")."""
    wide, wide_logits = greedy_with_logits("float32", 24)
    narrow, _ = greedy_with_logits("bfloat16", 24)
    same = 0
    for a, b, logits in zip(wide, narrow, wide_logits, strict=True):
        d = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if d is None:
            same += 1
            continue
        assert d >= 4  # the answers start alike
        margin = float(logits[d][a[d]] - logits[d][b[d]])  # float32's view of bf16's choice
        assert 0 <= margin < 0.5, (d, margin)
    assert same >= 3
