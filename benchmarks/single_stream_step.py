"""One stream's decode step (batch 1) against the time to read its bytes (issue 31's "a
batch-1 step within 1.3x of its weight-read time at the measured memory bandwidth").

Measures, in this order: the machine's memory bandwidth (a sum over a 1 GiB float32 buffer,
far larger than any cache: best of 5); a batch-1 decode step of SmolLM2 (one chat prompt
prefilled, then greedy and temperature-1 steps; the context is reset before it passes 400
positions); its parts alone on the same shapes: the 30 layers' matrix products, the lm_head,
and the sampler on the step's logits; and the bytes the step reads (every weight matrix with
its scales, the KV cache of the step's context). Prints the step against the read time
``bytes / bandwidth``. --profile adds a torch.profiler table over 10 greedy steps.

Run alone (exclusive bench lock):
  python benchmarks/single_stream_step.py [--threads 1] [--quantization none|int8|int4]
      [--compile off|auto] [--profile]
"""

from __future__ import annotations

import os
import time

from app.models.hf.threads import prepare_openmp

prepare_openmp()  # as the server does: OpenMP's passive wait, set before torch's first import

import torch  # noqa: E402
from _smollm2 import load, parser, timed  # noqa: E402

from app.models.hf.linear import Linear  # noqa: E402
from app.models.hf.llama import Weights  # noqa: E402
from app.models.protocol import GREEDY, PrefillChunk, SamplingParams, StepBatch  # noqa: E402

GIB = 1 << 30
STEPS = 40  # timed calls per figure
PARTS = {  # torch.profiler op names, grouped into the parts of a step
    "matrix products (layers + lm_head)": ("linear_pointwise", "int4pack_mm", "int8pack_mm"),
    "attention (SDPA)": ("scaled_dot_product",),
    "cache writes": ("index_put",),
    "sampling": ("argmax", "softmax", "cumsum", "searchsorted"),
}
RESET_AT = 400  # positions: the context is re-prefilled before it passes this


def bandwidth() -> float:
    """Bytes per second read by a sum over 1 GiB of float32 (best of 5)."""
    buffer = torch.ones(GIB // 4, dtype=torch.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - began)
    return buffer.nbytes / best


def linear_bytes(linear: Linear) -> int:
    """The bytes a product with ``linear`` reads: its weight, scales and bias (oneDNN's
    prepacked weight is opaque: its bfloat16 elements)."""
    if linear.kind == "packed":
        weight = linear.out_features * linear.in_features * 2
    else:
        weight = linear.weight.untyped_storage().nbytes()
    return weight + sum(t.nbytes for t in (linear.scales, linear.bias) if t is not None)


def weight_bytes(w: Weights) -> int:
    """The weight bytes one decode token reads: every layer's matrices and norms, the final
    norm, the lm_head and one embedding row."""
    total = linear_bytes(w.lm_head) + w.norm.nbytes + w.embed[0].nbytes
    for layer in w.layers:
        total += sum(linear_bytes(getattr(layer, n)) for n in ("qkv", "out", "gate_up", "down"))
        total += layer.input_norm.nbytes + layer.post_norm.nbytes
    return total


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    loaded = load(args)
    model, tok = loaded.model, loaded.tokenizer
    print(f"{torch.get_num_threads()} thread(s), {args.quantization}, compile {args.compile}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    read_per_s = bandwidth()
    print(f"memory bandwidth (sum over 1 GiB float32, best of 5): {read_per_s / 1e9:.1f} GB/s")
    prompt = tok.chat_prompt([("user", "What is the capital of France? Tell me a lot.")])
    prefill = StepBatch([], [], [], [], [PrefillChunk(0, prompt, 0, True, GREEDY, "r0")])
    last = model.step(prefill)
    contexts: list[int] = []

    def step(params: SamplingParams) -> None:
        nonlocal last
        if model.cache.lengths[0] >= RESET_AT:
            model.release(0)
            last = model.step(prefill)
        contexts.append(model.cache.lengths[0] + 1)
        last = model.step(StepBatch([0], last, [params], [""], []))

    greedy = timed("decode step, batch 1, greedy", lambda: step(GREEDY), STEPS)
    timed(
        "decode step, batch 1, temperature 1", lambda: step(SamplingParams(temperature=1.0)), STEPS
    )
    w: Weights = model._forward.weights
    x = torch.randn(1, w.embed.shape[1], dtype=w.embed.dtype)
    mlp = torch.randn(1, w.layers[0].down.in_features, dtype=w.embed.dtype)
    with torch.inference_mode():
        layers = timed(
            "the layers' matrix products alone",
            lambda: [(y.qkv(x), y.out(x), y.gate_up(x), y.down(mlp)) for y in w.layers],
            STEPS,
        )
        head = timed("the lm_head alone", lambda: w.lm_head(x).float(), STEPS)
        logits = w.lm_head(x).float()
        sampler = model._sampler
        timed("sampler, greedy", lambda: sampler.sample(logits, [GREEDY], [1]), STEPS)
        timed("sampler, temperature 1", lambda: sampler.sample(logits, [SamplingParams(temperature=1.0)], [1]), STEPS)  # fmt: skip
    cache = model.cache
    per_position = cache.keys[:, 0, :, 0].nbytes * 2  # keys and values, every layer
    context = sum(contexts) / len(contexts)
    weights = weight_bytes(w)
    kv = per_position * context
    read_ms = (weights + kv) / read_per_s * 1e3
    print(f"bytes a step reads: weights {weights / 1e6:.1f} MB + KV {kv / 1e6:.1f} MB "
          f"(mean context {context:.0f}) = {(weights + kv) / 1e6:.1f} MB: {read_ms:.2f} ms "
          f"at {read_per_s / 1e9:.1f} GB/s")  # fmt: skip
    print(f"greedy step / read time: {greedy / read_ms:.2f}x; products / read time: "
          f"{(layers + head) / read_ms:.2f}x; load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    if args.profile:
        with torch.profiler.profile() as prof:
            for _ in range(10):
                step(GREEDY)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        parts: dict[str, float] = {}
        for event in prof.key_averages():
            part = next((p for p, names in PARTS.items() if any(n in event.key for n in names)),
                        "everything else (norms, RoPE, SiLU, adds, views, casts, indexing)")  # fmt: skip
            parts[part] = parts.get(part, 0.0) + event.self_cpu_time_total / 1e3 / 10
        for part, ms in sorted(parts.items(), key=lambda item: -item[1]):
            print(f"  {part:70s} {ms:6.2f} CPU-ms per step (profiled)")


if __name__ == "__main__":
    main()
