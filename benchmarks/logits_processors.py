"""The cost of the real model's sampling stages per decode step, against the step itself.

Times, on float32 logits of SmolLM2's vocabulary (49,152) at batch 32, with one torch thread
and each row's history of 40 prompt + 200 output tokens:

- the logits processors when no row uses one (the engine does not even call them then),
- every row with frequency + presence + repetition penalties,
- every row with a 16-token logit_bias, min_tokens and 2 bad words,
- every row with penalties + bias + bans + an allow-list of 1,000 ids,
- log probabilities (top 20) of every row,
- the sampler (greedy, then temperature 1 with top-p 0.9) for scale.

Run: .venv/bin/python benchmarks/logits_processors.py [--batch 32] [--repeats 20]
Prints the median milliseconds per step of each; compare with a decode step at batch 32
(docs/benchmarks.md, "Real model": ~312 CPU-ms with one thread).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.models.hf import logits_processors, logprobs
from app.models.hf.sampling import Sampler
from app.models.protocol import SamplingParams

VOCAB = 49_152


@dataclass
class History:
    tokens: list[int]
    prompt_len: int
    stop_token_ids: frozenset[int] = frozenset({2})


def timed(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _processing(
    logits: torch.Tensor, rows: list[SamplingParams], histories: list[History]
) -> Callable[[], object]:
    def work() -> None:
        logits_processors.process(logits.clone(), rows, histories)

    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, VOCAB, generator=generator)
    rng = torch.Generator().manual_seed(1)
    histories = [
        History(torch.randint(0, VOCAB, (240,), generator=rng).tolist(), 40)
        for _ in range(args.batch)
    ]
    penalties = SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2)
    bias = tuple((i * 97, -100.0 if i % 2 else 5.0) for i in range(16))
    bans = SamplingParams(logit_bias=bias, min_tokens=300, bad_words=((5, 6), (7,)))
    everything = SamplingParams(
        frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, logit_bias=bias,
        min_tokens=300, bad_words=((5, 6), (7,)), allowed_token_ids=tuple(range(0, 49_000, 49)),
    )  # fmt: skip
    plain = SamplingParams()
    sampler = Sampler(1.0, torch.device("cpu"))
    positions = [240] * args.batch
    cases: list[tuple[str, Callable[[], object]]] = []
    for name, params in [("no row uses one", plain), ("penalties", penalties),
                         ("bias + min_tokens + bad words", bans),
                         ("all of them + allow-list", everything)]:  # fmt: skip
        cases.append((f"processors: {name}", _processing(logits, [params] * args.batch, histories)))
    chosen = logits.argmax(-1).tolist()
    cases.append(("log probabilities, top 20", lambda: logprobs.entries(
        logits, chosen, [20] * args.batch)))  # fmt: skip
    cases.append(("clone of the logits (baseline of the above)", lambda: logits.clone()))
    greedy = [SamplingParams(temperature=0.0)] * args.batch
    drawn = [SamplingParams(temperature=1.0, top_p=0.9)] * args.batch
    cases.append(("sampler: greedy", lambda: sampler.sample(logits, greedy, positions)))
    cases.append(("sampler: temperature 1, top-p 0.9", lambda: sampler.sample(
        logits, drawn, positions)))  # fmt: skip
    print(f"batch {args.batch}, vocabulary {VOCAB}, 1 torch thread, median of {args.repeats}")
    for name, work in cases:
        print(f"  {name:48s} {timed(work, args.repeats):8.2f} ms")


if __name__ == "__main__":
    main()
