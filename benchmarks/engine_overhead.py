"""Engine-core benchmark (issue: engine core, section 6). Prints, in one run:

1. engine overhead per decode step (wall time minus model time) with a zero-cost model, for the
   async Engine (model call in a worker thread, and inline) and for the sync generate(), at
   S = 1, 8, 32, 128, 256 slots. Goal: <= 100 us per step at S = 256.
2. generate() tokens/s against a plain 20-line slot-refill loop on the same workload, in
   --pairs alternating runs: the median of the pairs' ratios, and their middle half. Goal: >= 0.8x.
3. generate() cost per token with 16-token vs 8,000-token prompts. Goal: ratio <= 1.2.
4. chunked prefill: one 6,000-token prompt arriving among 4 decoding requests (cached mock, step
   clock 5 ms + 0.02 ms per prefill token), with --max-num-batched-tokens 512 and without a
   budget. Goal: the decoding requests' next token is delayed by at most one chunk's prefill.

Run: .venv/bin/python benchmarks/engine_overhead.py [--repeats N] [--steps N]
Every figure is the median of --repeats runs, measured side by side in this one process.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import time
from collections import deque

from app import MockModel, Request, generate
from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.step import StepOutcome
from app.engine.step_clock import StepCosts
from app.engine.types import Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock_language import MockLanguage

SLOT_COUNTS = (1, 8, 32, 128, 256)
NEVER = -1  # a stop token the zero-cost model never produces


class ZeroCostModel:
    """Returns token 1 for every sequence and times its own calls (the 'model time').
    ``blocking = False``: the engine calls it on the event loop, as it does the built-in mock."""

    blocking = False

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        started = time.perf_counter()
        out = [1] * len(batch)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return out


class BlockingZeroCostModel(ZeroCostModel):
    """The same, declared blocking: every call goes through the engine's worker thread."""

    blocking = True


async def engine_overhead_us(slots: int, steps: int, model: ZeroCostModel, readers: bool) -> float:
    """Per-step engine time: (wall - model time) / steps, with every slot busy for ``steps``
    steps; with ``readers``, every stream is also drained by a consumer task, as a server's
    handlers would (that is the cost of waking one task per request per step)."""
    engine = Engine(model, EngineConfig(num_slots=slots, max_waiting=0))
    await engine.start()
    seqs = [Sequence(f"r{i}", [7] * 16, steps, frozenset((NEVER,))) for i in range(slots)]
    started = time.perf_counter()
    streams = [engine.submit(seq) for seq in seqs]
    if readers:
        await asyncio.gather(*(stream.collect() for stream in streams))
    else:
        await engine.wait_idle()
    wall = time.perf_counter() - started
    await engine.stop()
    return (wall - model.seconds) / model.calls * 1e6


def generate_overhead_us(slots: int, steps: int) -> float:
    model = ZeroCostModel()
    requests = [Request(f"r{i}", [7] * 16, steps) for i in range(slots)]
    started = time.perf_counter()
    generate(model, requests, slots, NEVER)
    wall = time.perf_counter() - started
    return (wall - model.seconds) / model.calls * 1e6


def plain_generate(
    model: ZeroCostModel, requests: list[Request], num_slots: int, stop: int
) -> dict[str, list[int]]:
    """The straightforward loop a candidate would write: the yardstick for generate()."""
    results: dict[str, list[int]] = {r.request_id: [] for r in requests}
    queue = deque(r for r in requests if r.max_tokens > 0)
    active: list[tuple[Request, list[int], list[int]]] = []
    while queue or active:
        while queue and len(active) < num_slots:
            r = queue.popleft()
            active.append((r, list(r.prompt), results[r.request_id]))
        tokens = model.next_tokens([prefix for _, prefix, _ in active])
        still = []
        for (r, prefix, out), token in zip(active, tokens, strict=True):
            if token == stop:
                continue
            out.append(token)
            prefix.append(token)
            if len(out) < r.max_tokens:
                still.append((r, prefix, out))
        active = still
    return results


def workload(n: int, seed: int = 1) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(256) for _ in range(rng.randint(4, 64))],
                    rng.randint(1, 128)) for i in range(n)]  # fmt: skip


def tokens_per_second(fn: object, model: object, requests: list[Request], stop: int) -> float:
    assert callable(fn)
    started = time.perf_counter()
    out = fn(model, requests, 32, stop)
    return sum(len(v) for v in out.values()) / (time.perf_counter() - started)


def per_token_ns(prompt_len: int, n: int = 32, tokens: tuple[int, int] = (256, 1024)) -> float:
    """Marginal cost of one more generated token: the difference between two runs that differ
    only in max_tokens, so one-time work (validation, copying the prompt) cancels out."""
    times = []
    for max_tokens in tokens:
        requests = [Request(f"r{i}", [7] * prompt_len, max_tokens) for i in range(n)]
        started = time.perf_counter()
        generate(ZeroCostModel(), requests, n, NEVER)
        times.append(time.perf_counter() - started)
    return (times[1] - times[0]) / (n * (tokens[1] - tokens[0])) * 1e9


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=21, help="alternating runs in section 2")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per overhead run")
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, repeats={args.repeats}")

    print("\n1. engine overhead per step, zero-cost model (us, median)  goal: <= 100 at S=256")
    print("   engine: the engine task alone; +readers: also one consumer task per stream")
    header = ("S", "engine", "+readers", "thread", "thread+readers", "generate()")
    print("".join(f"{h:>15}" for h in header))
    for slots in SLOT_COUNTS:
        row = [
            median([asyncio.run(engine_overhead_us(slots, args.steps, model(), readers))
                    for _ in range(args.repeats)])
            for model, readers in ((ZeroCostModel, False), (ZeroCostModel, True),
                                   (BlockingZeroCostModel, False), (BlockingZeroCostModel, True))
        ]  # fmt: skip
        row.append(median([generate_overhead_us(slots, args.steps) for _ in range(args.repeats)]))
        print(f"{slots:>15}" + "".join(f"{v:>15.1f}" for v in row))

    print("\n2. generate() vs a plain 20-line loop, tokens/s  goal: >= 0.8x")
    print("   2,000 requests, prompts 4-64 tokens, max_tokens 1-128, 32 slots")
    requests = workload(2000)
    models = (("zero-cost model", ZeroCostModel), ("MockModel (random)", random_mock),
              ("MockModel, type-checked", checked_mock))  # fmt: skip
    for label, make in models:
        stop = random_mock().language.stop_token if label.startswith("Mock") else NEVER
        ours: list[float] = []
        plain: list[float] = []
        for _ in range(args.pairs):  # in turn, so a slow spell of the machine hits both alike
            ours.append(tokens_per_second(generate, make(), requests, stop))
            plain.append(tokens_per_second(plain_generate, make(), requests, stop))
        ratios = sorted(o / p for o, p in zip(ours, plain, strict=True))
        spread = f"(pairs: {ratios[len(ratios) // 4]:.2f}-{ratios[-1 - len(ratios) // 4]:.2f})"
        print(f"   {label:<24} generate() {median(ours):>12,.0f}   plain {median(plain):>12,.0f}"
              f"   {median(ratios):.2f}x {spread}")  # fmt: skip

    print("\n3. generate() marginal cost per generated token (ns)  goal: ratio <= 1.2")
    short = median([per_token_ns(16) for _ in range(args.repeats)])
    long = median([per_token_ns(8000) for _ in range(args.repeats)])
    print(f"   16-token prompts {short:,.0f}   8,000-token prompts {long:,.0f}   "
          f"ratio {long / short:.2f}")  # fmt: skip

    print("\n4. a 6,000-token prompt among 4 decoding requests (5 ms + 0.02 ms/prefill token)")
    print("   goal: with a budget, a decode's next token waits at most one chunk's prefill")
    report_long_prompt()


class StepLog:
    """Observer: (prefill tokens, decode tokens, seconds since the previous step's end)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []
        self._last: float | None = None

    def on_step(self, outcome: StepOutcome) -> None:
        out = outcome.output
        gap = 0.0 if self._last is None else outcome.ended_at - self._last
        self.steps.append((out.num_prefill_tokens, out.num_decode_tokens, gap))
        self._last = outcome.ended_at

    def on_finished(self, seq: Sequence) -> None:
        pass


async def long_prompt_among_decodes(budget: int | None) -> list[tuple[int, int, float]]:
    """4 requests decode; after 5 steps a 6,000-token prompt arrives. Returns the step log."""
    log = StepLog()
    costs = StepCosts(step_ms=5.0, prefill_token_ms=0.02)
    config = EngineConfig(num_slots=8, max_num_batched_tokens=budget, step_costs=costs)
    engine = Engine(CachedMockModel(8), config, observer=log)
    await engine.start()
    decoders = [engine.submit(Sequence(f"d{i}", [7, i], 40, frozenset((NEVER,))))
                for i in range(4)]  # fmt: skip
    while len(log.steps) < 5:
        await asyncio.sleep(0.001)
    engine.submit(Sequence("long", [7] * 6000, 1, frozenset((NEVER,))))
    await asyncio.gather(*(stream.collect() for stream in decoders))
    await engine.stop()
    return log.steps


def report_long_prompt() -> None:
    for budget in (512, None):
        steps = asyncio.run(long_prompt_among_decodes(budget))
        prefill_steps = [(p, d, g) for p, d, g in steps if p > 0 and d > 0]
        worst = max(g for _, _, g in prefill_steps) * 1e3
        typical = statistics.median(g for p, _, g in steps[1:] if p == 0) * 1e3
        label = "no budget" if budget is None else f"budget {budget}"
        counts = ", ".join(f"{p}+{d}" for p, d, _ in prefill_steps)
        print(f"   {label:<11} steps with the long prompt (prefill+decode tokens): {counts}")
        print(f"   {'':<11} decode gap: plain step {typical:.1f} ms, worst while prefilling "
              f"{worst:.1f} ms (delay {worst - typical:.1f} ms)")  # fmt: skip


def random_mock() -> MockModel:
    """The built-in stateless mock in random mode (its tokens cost what a real call would)."""
    return MockModel(MockLanguage(vocab_size=257, stop_token=256, text=False))


class TypeCheckedMock(MockModel):
    """The same mock without its ``returns_int_tokens`` promise: the runner type-checks each of
    its tokens, as it does any third-party model's."""

    returns_int_tokens = False


def checked_mock() -> MockModel:
    return TypeCheckedMock(MockLanguage(vocab_size=257, stop_token=256, text=False))


if __name__ == "__main__":
    main()
