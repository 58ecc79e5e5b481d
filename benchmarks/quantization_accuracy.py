"""Weight-only int8/int4 (--quantization) against bfloat16 on SmolLM2-135M-Instruct.

Eight chat prompts, 32 greedy tokens each from the bfloat16 model; the quantized model is fed
the same tokens (teacher forcing), and at every position we compare: greedy match rate (its
argmax equals bfloat16's), mean absolute logit error, and the top-1 logit margin where they
differ. Also the batch-1 decode step time of each (one thread, in-process).

Run alone (exclusive bench lock): python benchmarks/quantization_accuracy.py [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from app.models.hf import load_model
from app.models.protocol import GREEDY, PrefillChunk, StepBatch

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
NEW = 32


def logits_along(quantization: str, forced: list[list[int]] | None) -> tuple[list[list[int]], torch.Tensor]:  # fmt: skip
    """Greedy tokens (or ``forced`` ones) and the logits at each of NEW positions per prompt."""
    loaded = load_model("smollm2", dtype="bfloat16", num_slots=len(QUESTIONS), max_model_len=256,
                        kv_cache_memory=1 << 28, quantization=quantization)  # fmt: skip
    tok, model = loaded.tokenizer, loaded.model
    slots = list(range(len(QUESTIONS)))
    chunks = [PrefillChunk(i, tok.chat_prompt([("user", q)]), 0, True, GREEDY, f"r{i}")
              for i, q in enumerate(QUESTIONS)]  # fmt: skip
    steps = [model.step_logits(StepBatch([], [], [], [], chunks))]
    tokens = [[t] for t in steps[0].argmax(-1).tolist()]
    for n in range(1, NEW):
        feed = [(forced[i] if forced else tokens[i])[n - 1] for i in slots]
        steps.append(model.step_logits(StepBatch(slots, feed, [GREEDY] * 8, [""] * 8, [])))
        for out, t in zip(tokens, steps[-1].argmax(-1).tolist(), strict=True):
            out.append(t)
    return tokens, torch.stack(steps, dim=1)  # (prompts, NEW, vocab)


def step_ms(quantization: str) -> float:
    loaded = load_model("smollm2", dtype="bfloat16", num_slots=1, max_model_len=256,
                        kv_cache_memory=1 << 28, quantization=quantization)  # fmt: skip
    model, tok = loaded.model, loaded.tokenizer
    prompt = tok.chat_prompt([("user", QUESTIONS[0])])
    out = model.step(StepBatch([], [], [], [], [PrefillChunk(0, prompt, 0, True, GREEDY, "r")]))
    for _ in range(5):
        out = model.step(StepBatch([0], out, [GREEDY], ["r"], []))
    start = time.perf_counter()
    for _ in range(40):
        out = model.step(StepBatch([0], out, [GREEDY], ["r"], []))
    return (time.perf_counter() - start) / 40 * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    torch.set_num_threads(parser.parse_args().threads)
    print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} thread(s)")
    reference, ref_logits = logits_along("none", None)
    print(f"bfloat16: batch-1 decode step {step_ms('none'):.1f} ms")
    for quantization in ("int8", "int4"):
        _, logits = logits_along(quantization, reference)
        match = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        error = (logits - ref_logits).abs().mean().item()
        spread = ref_logits.std(-1).mean().item()
        print(f"{quantization}: greedy match {match:.1%} of {logits.shape[0] * NEW} positions, "
              f"mean |logit error| {error:.3f} (logits' own std {spread:.2f}); batch-1 decode "
              f"step {step_ms(quantization):.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
