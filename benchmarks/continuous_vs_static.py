"""Continuous vs static batching on the same engine (the product's reason to exist).

All requests arrive at once (as in Anyscale's benchmark); output lengths are exponential with
mean 128, capped at 512; the engine's step clock gives each step a fixed --step-ms whatever the batch size,
as a GPU step roughly does. The only difference between the runs is the admission policy.

Run: .venv/bin/python benchmarks/continuous_vs_static.py [--requests 256] [--slots 32] [--step-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.scheduler import BatchingPolicy
from app.engine.step_clock import StepCosts
from app.engine.types import Sequence
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage


def lengths(n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [min(512, max(1, round(rng.expovariate(1 / 128)))) for _ in range(n)]


async def run(
    policy: BatchingPolicy, outputs: list[int], slots: int, step_ms: float
) -> dict[str, float]:
    language = MockLanguage(text=False, stop_probability=0.0)  # lengths come from max_tokens
    config = EngineConfig(num_slots=slots, max_waiting=len(outputs), batching=policy,
                          step_costs=StepCosts(step_ms=step_ms))  # fmt: skip
    engine = Engine(MockModel(language), config)
    await engine.start()
    started = time.monotonic()
    streams = [
        engine.submit(Sequence(f"r{i}", [1, 2, 3], n, frozenset())) for i, n in enumerate(outputs)
    ]
    latencies, first_tokens = [], []
    for stream in streams:
        await stream.collect()
        times = stream.seq.times
        assert times.finished is not None and times.first_token is not None
        latencies.append(times.finished - times.arrival)
        first_tokens.append(times.first_token - times.arrival)
    elapsed = time.monotonic() - started
    await engine.stop()
    return {
        "seconds": elapsed,
        "tokens_per_s": sum(outputs) / elapsed,
        "mean_latency": statistics.mean(latencies),
        "p50_ttft": statistics.median(first_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=2.0)
    args = parser.parse_args()
    outputs = lengths(args.requests)
    print(f"{args.requests} requests, {args.slots} slots, {args.step_ms} ms step, "
          f"output tokens mean {statistics.mean(outputs):.0f}, max {max(outputs)}")  # fmt: skip
    results = {p: asyncio.run(run(p, outputs, args.slots, args.step_ms)) for p in BatchingPolicy}
    print(f"{'policy':>12}{'seconds':>10}{'tokens/s':>12}{'mean E2E s':>12}{'p50 TTFT s':>12}")
    for policy, r in results.items():
        print(f"{policy.value:>12}{r['seconds']:>10.2f}{r['tokens_per_s']:>12,.0f}"
              f"{r['mean_latency']:>12.2f}{r['p50_ttft']:>12.2f}")  # fmt: skip
    cont, stat = results[BatchingPolicy.CONTINUOUS], results[BatchingPolicy.STATIC]
    print(f"continuous / static throughput: {cont['tokens_per_s'] / stat['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
