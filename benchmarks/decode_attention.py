"""Decode attention candidates over the slot cache (issue 31): SmolLM2's shape (3 KV heads x 3
queries x head dim 64, bf16), a batch of 32 decode rows over a strided view of a 30-layer
cache, each row masked to its own length; CPU-ms per layer call on one thread.

Run alone (exclusive bench lock):
  flock /tmp/bench.lock python benchmarks/decode_attention.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

BATCH, KV_HEADS, GROUP, HEAD_DIM, CONTEXT = 32, 3, 3, 64, 512


def cpu_ms(fn: Callable[[], object], n: int = 200) -> float:
    for _ in range(5):
        fn()
    began = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - began) / n * 1e3


def matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Two batched matmuls around a float32 softmax."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * HEAD_DIM**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    out: torch.Tensor = (scores.softmax(-1) @ v.float()).to(q.dtype)
    return out


def measure(
    length: int, keys: torch.Tensor, values: torch.Tensor, compiled: Callable[..., object]
) -> None:
    """Times every candidate at ``length`` keys, printing one line each."""
    q = torch.randn(BATCH, KV_HEADS, GROUP, HEAD_DIM, dtype=torch.bfloat16)
    k, v = keys[3, :, :, :length], values[3, :, :, :length]
    lengths = torch.randint(length // 2, length + 1, (BATCH,))
    mask = (torch.arange(length) < lengths[:, None]).view(BATCH, 1, 1, length)
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
    dense_k, dense_v = k.contiguous(), v.contiguous()
    candidates: dict[str, Callable[[], object]] = {
        "SDPA, bool mask (today)": lambda: F.scaled_dot_product_attention(q, k, v, mask),
        "SDPA, additive mask": lambda: F.scaled_dot_product_attention(q, k, v, additive),
        "SDPA, contiguous K/V": lambda: F.scaled_dot_product_attention(q, dense_k, dense_v, mask),
        "matmul + float32 softmax": lambda: matmul_attention(q, k, v, mask),
        "matmul + float32 softmax, torch.compile": lambda: compiled(q, k, v, mask),
    }
    with torch.inference_mode():
        for name, fn in candidates.items():
            print(f"{length:4d} keys  {name:42s} {cpu_ms(fn):7.3f} CPU-ms", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    shape = (30, BATCH, KV_HEADS, CONTEXT, HEAD_DIM)
    keys, values = (
        torch.randn(shape, dtype=torch.bfloat16),
        torch.randn(shape, dtype=torch.bfloat16),
    )
    compiled = torch.compile(matmul_attention, dynamic=True)
    for length in (60, 300):
        measure(length, keys, values, compiled)


if __name__ == "__main__":
    main()
