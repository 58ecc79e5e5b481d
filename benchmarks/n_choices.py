"""n choices with a shared prompt prefill (forks) against n independent prefills, on SmolLM2.

One request of ``--n`` choices (temperature 1, seeded, EOS ignored) with a ``--prompt-tokens``
prompt and ``--max-tokens`` each, run through the engine (``Engine``, ``--n`` slots) with
``share_prompts`` on (choices after the first fork from its prompt cache) and off (each choice
prefills its own prompt), alternated ``--repeats`` times. Prints, per mode: the prompt tokens the
model computed, the time to every choice's first token (first and last choice), the wall time
to the last token, and whether both modes gave the same tokens (float32: they must).

Run alone (exclusive bench lock):
  flock /tmp/bench.gate flock /tmp/bench.lock python benchmarks/n_choices.py [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.step import StepOutcome
from app.engine.types import Sequence
from app.models.hf import load_model
from app.models.protocol import SamplingParams

TEXT = (
    "Continuous batching keeps every slot of the batch busy: when a request finishes, the "
    "scheduler admits a waiting one into its slot before the next model call. "
)


class PrefillCounter:
    """Counts the prompt tokens each step fed the model."""

    def __init__(self) -> None:
        self.prefill_tokens = 0

    def on_step(self, outcome: StepOutcome) -> None:
        self.prefill_tokens += outcome.output.num_prefill_tokens

    def on_finished(self, seq: Sequence) -> None:
        pass


async def run_once(
    model: object, prompt: list[int], args: argparse.Namespace, share: bool
) -> dict[str, object]:
    counter = PrefillCounter()
    config = EngineConfig(num_slots=args.n, max_waiting=args.n, share_prompts=share)
    engine = Engine(model, config, counter)  # type: ignore[arg-type]
    await engine.start()
    first: Sequence | None = None
    seqs = []
    start = time.monotonic()
    for i in range(args.n):
        sampling = SamplingParams(temperature=1.0, seed=7 + i)
        seq = Sequence(f"c{i}", list(prompt), args.max_tokens, frozenset(), sampling=sampling,
                       fork_of=first)  # fmt: skip
        first = first or seq
        seqs.append(seq)
        engine.submit(seq)
    await engine.wait_idle()
    await engine.stop()
    firsts = [s.times.first_token or 0.0 for s in seqs]
    return {
        "prefill": counter.prefill_tokens,
        "ttft_first": (firsts[0] - start) * 1e3,
        "ttft_last": (max(firsts) - start) * 1e3,
        "wall": (max(s.times.finished or 0.0 for s in seqs) - start) * 1e3,
        "tokens": [s.generated for s in seqs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    loaded = load_model("smollm2", dtype=args.dtype, num_slots=args.n,
                        max_model_len=args.prompt_tokens + args.max_tokens + 8,
                        kv_cache_memory=1 << 30)  # fmt: skip
    ids = loaded.tokenizer.encode(TEXT * (args.prompt_tokens // 20 + 1))
    prompt = ids[: args.prompt_tokens]
    print(f"SmolLM2 {args.dtype}, n={args.n}, prompt {len(prompt)} tokens, {args.max_tokens} "
          f"tokens per choice, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    results: dict[bool, list[dict[str, object]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for share in (False, True):
            results[share].append(asyncio.run(run_once(loaded.model, prompt, args, share)))
    for share in (False, True):
        runs = results[share]
        name = "forks (shared prefill)" if share else "independent prefills"

        def med(key: str, runs: list[dict[str, object]] = runs) -> float:
            return statistics.median(float(r[key]) for r in runs)  # type: ignore[arg-type]

        print(f"{name:24s} prompt tokens computed {med('prefill'):6.0f}   first choice's TTFT "
              f"{med('ttft_first'):7.0f} ms   last choice's TTFT {med('ttft_last'):7.0f} ms   "
              f"all done {med('wall'):7.0f} ms")  # fmt: skip
    same = results[True][0]["tokens"] == results[False][0]["tokens"]
    print(f"same tokens in both modes: {same}")


if __name__ == "__main__":
    main()
