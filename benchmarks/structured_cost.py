"""The cost of structured outputs per engine step (issue 20B): 32 constrained streams (a JSON
schema) vs 32 free ones.

1. Mock (--mock): the scheduler + runner loop (the engine's own work, as in
   benchmarks/engine_overhead.py) with 256 slots, every slot busy: 256 free requests vs 224 free
   + 32 constrained (the text mock's tokens steered by the grammar). Per step: wall time minus
   the model's time. Goal: constrained <= 2x free. Constrained requests that finish are replaced
   between steps (their compile, done in the HTTP handler in the server, is timed apart).
2. Real model (--real): SmolLM2 through Scheduler + CachedRunner + HFModel, 32 slots decoding,
   greedy: 32 free vs 32 constrained. Per step: wall time, and the mask work inside it (the
   runner's mask computation, the logits masking in HFModel, the matchers' accept). Goal: mask
   work <= 10% of a decode step.

Run: flock /tmp/bench.gate flock /tmp/bench.lock .venv/bin/python benchmarks/structured_cost.py
     [--mock] [--real] [--steps N] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from app.engine.runner import make_runner
from app.engine.scheduler import Scheduler
from app.engine.types import Sequence
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import GREEDY
from app.models.tokenizer import ByteTokenizer, Tokenizer
from app.structured.constraint import Constraint
from app.structured.grammar import GrammarCompiler, GrammarMatcher

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "tags", "city"],
    "additionalProperties": False,
}
CONSTRAINT = Constraint.json_schema(SCHEMA)


class Timers:
    """Seconds spent in named sections (the grammar work is patched in to be timed)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def wrap(self, owner: Any, attribute: str, name: str) -> Callable[[], None]:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.section(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)
        return lambda: setattr(owner, attribute, original)


class TimedMock(MockModel):
    def __init__(self, timers: Timers) -> None:
        super().__init__(MockLanguage(seed=3, stop_probability=0.0))
        self.timers = timers

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        with self.timers.section("model"):
            return super().next_tokens(batch)


def run(
    model: Any,
    tokenizer: Tokenizer,
    compiler: GrammarCompiler,
    slots: int,
    constrained: int,
    steps: int,
    prompt: list[int],
    timers: Timers,
) -> float:
    """Per-step seconds (wall minus model) over ``steps`` steps with every slot busy."""
    scheduler = Scheduler(slots)
    runner = make_runner(model, slots)
    live: list[Sequence] = []
    counter = 0

    def add(kind: bool) -> None:
        nonlocal counter
        counter += 1
        seq = Sequence(f"r{counter}", [*prompt, counter % 251], 10**6, frozenset(), sampling=GREEDY)
        if kind:
            with timers.section("compile"):
                seq.constraint = compiler.matcher(CONSTRAINT)
            seq.stop_token_ids = tokenizer.stop_token_ids
        scheduler.add(seq, 0.0)
        live.append(seq)

    for i in range(slots):
        add(i < constrained)
    for _ in range(3):  # admissions and prefills out of the way
        scheduler.update(out := scheduler.schedule(0.0), runner.execute(out), 0.0)
    timers.seconds.clear()
    wall = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        out = scheduler.schedule(0.0)
        scheduler.update(out, runner.execute(out), 0.0)
        wall += time.perf_counter() - start
        done = [seq for seq in live if seq.finished]
        for seq in done:
            live.remove(seq)
            add(True)  # only constrained requests finish (free ones have no stop token)
    timers.seconds["finished"] = float(counter - slots)
    runner.close()
    return (wall - timers.seconds.get("model", 0.0)) / steps


def mock_figures(steps: int, repeats: int) -> None:
    """Headline: wall minus model time, nothing patched. Breakdown: a second run with the
    grammar calls timed (the timers' own cost inflates that run)."""
    tokenizer = ByteTokenizer()
    compiler = GrammarCompiler(tokenizer)
    prompt = list(b"user: describe someone\nassistant: ")
    print(f"mock, 256 slots, {steps} steps, median of {repeats} (alternated)")
    results: dict[int, list[float]] = {0: [], 32: []}
    for _ in range(repeats):
        for constrained in (0, 32):
            timers = Timers()
            model = TimedMock(timers)
            results[constrained].append(
                run(model, tokenizer, compiler, 256, constrained, steps, prompt, timers)
            )
    free, constrained_us = statistics.median(results[0]), statistics.median(results[32])
    for n, value in ((0, free), (32, constrained_us)):
        print(f"  constrained {n:3}: engine work {value * 1e6:8.1f} us/step")
    print(f"  ratio {constrained_us / free:.2f}x")
    timers = Timers()
    undo = [timers.wrap(GrammarMatcher, "choose", "choose"),
            timers.wrap(GrammarMatcher, "accept", "accept")]  # fmt: skip
    run(TimedMock(timers), tokenizer, compiler, 256, 32, steps, prompt, timers)
    for restore in undo:
        restore()
    ex = timers.seconds
    print(f"  breakdown (timed run): choose {ex.get('choose', 0) / steps * 1e6:.1f} us, accept "
          f"{ex.get('accept', 0) / steps * 1e6:.1f} us per step; {ex.get('finished', 0):.0f} "
          "constrained requests finished and replaced")  # fmt: skip


def real_figures(steps: int, threads: int) -> None:
    import torch

    from app.models.hf import load_model
    from app.models.hf import runner as hf_runner

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model("smollm2", num_slots=32, max_model_len=1024, kv_cache_memory=1 << 30)
    compiler = GrammarCompiler(loaded.tokenizer)
    prompt = loaded.tokenizer.chat_prompt([("user", "Describe a person as JSON.")])
    print(
        f"SmolLM2, 32 slots decoding, {steps} steps, greedy, torch threads {torch.get_num_threads()}"
    )
    for constrained in (0, 32, 0, 32):
        timers = Timers()
        undo = [
            timers.wrap(GrammarMatcher, "mask", "mask"),
            timers.wrap(GrammarMatcher, "accept", "accept"),
            timers.wrap(hf_runner, "apply_token_masks", "apply"),
        ]
        per_step = run(
            loaded.model, loaded.tokenizer, compiler, 32, constrained, steps, prompt, timers
        )
        for restore in undo:
            restore()
        work = sum(timers.seconds.get(k, 0.0) for k in ("mask", "accept", "apply")) / steps
        print(f"  constrained {constrained:2}: step {per_step * 1e3:7.2f} ms; mask work {work * 1e3:6.2f} ms"
              f" ({work / per_step:5.1%}): masks {timers.seconds.get('mask', 0) / steps * 1e3:.2f}, "
              f"logits {timers.seconds.get('apply', 0) / steps * 1e3:.2f}, accept "
              f"{timers.seconds.get('accept', 0) / steps * 1e3:.2f} ms; "
              f"{timers.seconds.get('finished', 0):.0f} requests finished and replaced")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mock", action="store_true")
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--real-steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    both = not args.mock and not args.real
    if args.mock or both:
        mock_figures(args.steps, args.repeats)
    if args.real or both:
        real_figures(args.real_steps, args.threads)


if __name__ == "__main__":
    main()
