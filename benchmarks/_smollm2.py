"""What the in-process SmolLM2 step benchmarks share (real_model_step.py, single_stream_step.py):
their command line, the model load, and the timer."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

from app.models.hf import LoadedModel, load_model


def parser(description: str) -> argparse.ArgumentParser:
    """The shared flags: --threads (default 1), --dtype, --quantization, --compile, --profile."""
    parsed = argparse.ArgumentParser(description=description)
    parsed.add_argument("--threads", type=int, default=1)
    parsed.add_argument("--dtype", default="auto")
    parsed.add_argument("--quantization", default="none")
    parsed.add_argument("--compile", default="off", choices=("off", "auto"))
    parsed.add_argument("--profile", action="store_true")
    return parsed


def load(args: argparse.Namespace) -> LoadedModel:
    """SmolLM2 with 32 slots of 512 positions, as ``args`` (from ``parser``) say; the
    loader's log (dtype, compile times) goes to stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return load_model("smollm2", dtype=args.dtype, num_slots=32, max_model_len=512,
                      kv_cache_memory=1 << 30, threads=args.threads,
                      quantization=args.quantization, compile=args.compile)  # fmt: skip


def timed(name: str, fn: Callable[[], object], n: int = 20) -> float:
    """Prints and returns the mean wall milliseconds of ``fn`` over ``n`` calls after 3 warm-ups
    (CPU milliseconds printed beside: a shared machine shows in their gap)."""
    for _ in range(3):
        fn()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    ms = (time.perf_counter() - wall) / n * 1e3
    print(f"{name:46s} {ms:8.2f} ms wall {(time.process_time() - cpu) / n * 1e3:8.2f} ms CPU",
          flush=True)  # fmt: skip
    return ms
