"""One batch-32 decode step of SmolLM2 against the matrix products it contains (issue 19's
"per-step CPU within 1.3x of the step's matmul time").

Loads SmolLM2 with 32 slots, prefills 32 chat prompts, times 20 decode steps (greedy, then all
rows at temperature 1) after 3 warm-ups, then times the step's products alone (qkv, out,
gate_up, down for every layer + lm_head) on a random (32, hidden) input. --profile adds a
torch.profiler table over 5 greedy steps.

Run alone (exclusive bench lock):
  python benchmarks/real_model_step.py [--threads 1] [--dtype auto] [--quantization none]
      [--compile off|auto] [--profile]
"""

from __future__ import annotations

import os

import torch
from _smollm2 import load, parser, timed

from app.models.protocol import GREEDY, PrefillChunk, SamplingParams, StepBatch


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    loaded = load(args)
    model, tok = loaded.model, loaded.tokenizer
    prompt = tok.chat_prompt([("user", "What is the capital of France? Tell me a lot.")])
    chunks = [PrefillChunk(i, prompt, 0, True, GREEDY, f"r{i}") for i in range(32)]
    last = model.step(StepBatch([], [], [], [], chunks))
    slots = list(range(32))

    def step(params: SamplingParams) -> None:
        nonlocal last
        last = model.step(StepBatch(slots, last, [params] * 32, [""] * 32, []))

    print(f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.2f}")
    timed("decode step, batch 32, greedy", lambda: step(GREEDY))
    timed("decode step, batch 32, temperature 1", lambda: step(SamplingParams(temperature=1.0)))
    w = model._forward.weights
    x = torch.randn(32, w.embed.shape[1], dtype=w.embed.dtype)
    mlp = torch.randn(32, w.layers[0].down.in_features, dtype=w.embed.dtype)

    def products() -> None:
        for layer in w.layers:
            layer.qkv(x), layer.out(x), layer.gate_up(x), layer.down(mlp)
        w.lm_head(x)

    timed("the step's matrix products alone", products)
    if args.profile:
        with torch.profiler.profile() as prof:
            for _ in range(5):
                step(GREEDY)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
