"""The requests a simulation replays: from an inference-perf config or a JSONL trace.

inference-perf (kubernetes-sigs/inference-perf) generates them as follows, and so does this:

- ``data.type: shared_prefix``: ``num_groups`` groups of ``num_prompts_per_group`` prompts;
  each prompt is its group's system prompt (``system_prompt_len`` random tokens) followed by a
  question of its own (``question_len``, or ``question_distribution``); ``output_len`` (or
  ``output_distribution``) is its ``max_tokens``. The prompts are shuffled once and requests
  cycle through them, so a prompt comes back every ``groups x prompts`` requests.
- ``data.type: random``: ``input_distribution`` and ``output_distribution`` (min, max, mean,
  std_dev, total_count): lengths drawn from a clipped normal; request ``n`` takes entry
  ``n % total_count``; every prompt is new.
- ``load.type: constant``: ``rate x duration`` requests per stage, exponential gaps scaled to
  fill the duration exactly; ``poisson``: each second a Poisson(rate) count of requests, spread
  the same way over that second. A stage starts once the previous one's requests have ended,
  after ``load.interval`` seconds (default 1).

A trace is JSONL, one request per line: ``{"arrival": seconds, "prompt_len": n | "prompt_tokens":
[ids], "output_len": n, "prefix_group": "name", "prefix_len": n}`` (the last two optional: the
first ``prefix_len`` tokens are shared by every request of the group). Token ids are random in
the model's vocabulary; only their equality matters (the prefix cache).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 16  # tokens that make a prompt unique: its first block differs from every other's


class WorkloadError(ValueError):
    """An inference-perf config or trace ``simulate`` cannot replay (names what and where)."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request: sent at ``arrival`` (seconds from the start of its stage); ``priority``
    and ``user`` as the scheduling policies read them."""

    arrival: float
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    user: str | None = None


@dataclass(slots=True)
class Stage:
    """One load stage: its requests in arrival order; ``rate`` and ``duration`` as configured
    (0 for a trace)."""

    requests: list[SimRequest]
    rate: float = 0.0
    duration: float = 0.0


@dataclass(slots=True)
class Workload:
    stages: list[Stage]
    interval: float = 1.0  # seconds between a stage's end and the next one's start
    source: dict[str, Any] = field(default_factory=dict)


# --- lengths and arrival times ---------------------------------------------------------------


def _lengths(rng: random.Random, spec: Any, count: int, what: str) -> list[int]:
    """``count`` lengths: a fixed int, or a distribution {min, max, mean, std_dev} (a normal,
    clipped and rounded, as inference-perf draws them)."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 0:
            raise WorkloadError(f"{what} must be >= 0, got {spec}")
        return [spec] * count
    if not isinstance(spec, dict):
        raise WorkloadError(f"{what} must be an integer or a distribution, got {spec!r}")
    try:
        low, high = int(spec["min"]), int(spec["max"])
        mean, std = float(spec["mean"]), float(spec.get("std_dev", 0.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkloadError(f"{what}: a distribution needs min, max, mean (and std_dev)") from exc
    if not low <= mean <= high or std < 0 or low < 0:
        raise WorkloadError(f"{what}: needs 0 <= min <= mean <= max and std_dev >= 0")
    return [
        int(min(high, max(low, round(rng.gauss(mean, std) if std else mean)))) for _ in range(count)
    ]


def _spread(rng: random.Random, count: int, start: float, duration: float) -> list[float]:
    """``count`` times over ``[start, start + duration]``: exponential gaps scaled so that they
    add up to ``duration`` (inference-perf's constant load)."""
    gaps = [rng.expovariate(1.0) for _ in range(count)]
    scale = duration / sum(gaps) if count else 0.0
    times, t = [], start
    for gap in gaps:
        t += gap * scale
        times.append(t)
    return times


def _poisson(rng: random.Random, rate: float) -> int:
    """A Poisson(rate) draw (Knuth's method for small rates, a rounded normal beyond)."""
    if rate > 60:
        return max(0, round(rng.gauss(rate, math.sqrt(rate))))
    limit, k, p = math.exp(-rate), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def arrival_times(rng: random.Random, kind: str, rate: float, duration: float) -> list[float]:
    if kind == "constant":
        return _spread(rng, int(rate * duration), 0.0, duration)
    times: list[float] = []
    for second in range(math.ceil(duration)):
        times += _spread(rng, _poisson(rng, rate), float(second), 1.0)
    return [t for t in times if t <= duration]


# --- prompts ---------------------------------------------------------------------------------


class _Tokens:
    """Random token ids: a prompt of ``n`` new tokens is a unique first block and then a shared
    filler (block hashes chain, so every block of it is new to the prefix cache)."""

    def __init__(self, rng: random.Random, vocab: int) -> None:
        self.rng, self.vocab = rng, vocab
        self._filler: list[int] = []

    def new(self, n: int) -> list[int]:
        head = [self.rng.randrange(self.vocab) for _ in range(min(n, BLOCK))]
        rest = n - len(head)
        while len(self._filler) < rest:
            self._filler += [self.rng.randrange(self.vocab) for _ in range(4096)]
        return head + self._filler[:rest]


def _data(
    config: dict[str, Any], rng: random.Random, vocab: int
) -> Iterator[tuple[list[int], int]]:
    """(prompt, max_tokens) of request 0, 1, 2, ... for the ``data`` section."""
    kind = config.get("type")
    tokens = _Tokens(rng, vocab)
    if kind == "shared_prefix":
        spec = config.get("shared_prefix")
        if not isinstance(spec, dict):
            raise WorkloadError("data.shared_prefix: missing (the shared_prefix data's settings)")
        try:
            groups, per_group = int(spec["num_groups"]), int(spec["num_prompts_per_group"])
            system_len = int(spec["system_prompt_len"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"data.shared_prefix: missing or bad {exc}") from exc
        if groups < 1 or per_group < 1 or system_len < 0:
            raise WorkloadError("data.shared_prefix: num_groups, num_prompts_per_group >= 1")
        question = spec.get("question_distribution") or spec.get("question_len")
        output = spec.get("output_distribution") or spec.get("output_len")
        prompts: list[tuple[list[int], int]] = []
        for _ in range(groups):
            system = tokens.new(system_len)
            questions = _lengths(rng, question, per_group, "data.shared_prefix.question_len")
            outputs = _lengths(rng, output, per_group, "data.shared_prefix.output_len")
            for q, o in zip(questions, outputs, strict=True):
                prompts.append((system + tokens.new(q), o))
        rng.shuffle(prompts)
        i = 0
        while True:
            yield prompts[i % len(prompts)]
            i += 1
    elif kind == "random":
        dists = {}
        for name in ("input_distribution", "output_distribution"):
            dist = config.get(name)
            if not isinstance(dist, dict):
                raise WorkloadError(f"data.{name}: missing (random data needs it)")
            count = dist.get("total_count") or 1000
            dists[name] = _lengths(rng, dist, int(count), f"data.{name}")
        inputs, outputs = dists["input_distribution"], dists["output_distribution"]
        n = 0
        while True:
            yield tokens.new(inputs[n % len(inputs)]), outputs[n % len(outputs)]
            n += 1
    else:
        raise WorkloadError(
            f"data.type {kind!r} is not supported by simulate (supported: shared_prefix, random)"
        )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml
        except ImportError as exc:
            raise WorkloadError(f"{path} is not JSON, and PyYAML is not installed") from exc
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise WorkloadError(f"{path} is neither JSON nor YAML: {exc}") from exc
    if not isinstance(config, dict):
        raise WorkloadError(f"{path}: an inference-perf config is a mapping")
    return config


def from_inference_perf(config: dict[str, Any], vocab: int, seed: int = 0) -> Workload:
    """The workload of an inference-perf config (its ``data`` and ``load`` sections)."""
    data, load = config.get("data"), config.get("load")
    if not isinstance(data, dict):
        raise WorkloadError("the inference-perf config has no data section")
    if not isinstance(load, dict):
        raise WorkloadError("the inference-perf config has no load section")
    kind = load.get("type", "constant")
    if kind not in ("constant", "poisson"):
        raise WorkloadError(
            f"load.type {kind!r} is not supported by simulate (supported: constant, poisson)"
        )
    stages_spec = load.get("stages")
    if not isinstance(stages_spec, list) or not stages_spec:
        raise WorkloadError("load.stages: a list of {rate, duration} is needed")
    rng = random.Random(seed)
    requests = _data(data, rng, vocab)
    stages: list[Stage] = []
    for i, spec in enumerate(stages_spec):
        try:
            rate, duration = float(spec["rate"]), float(spec["duration"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"load.stages[{i}]: needs a rate and a duration") from exc
        if rate <= 0 or duration <= 0:
            raise WorkloadError(f"load.stages[{i}]: rate and duration must be > 0")
        times = arrival_times(rng, kind, rate, duration)
        stage = [SimRequest(t, *next(requests)) for t in times]
        stages.append(Stage(stage, rate, duration))
    interval = float(load.get("interval") or 1.0)
    return Workload(stages, interval, config)


def load_inference_perf(path: str | Path, vocab: int, seed: int = 0) -> Workload:
    return from_inference_perf(_read_config(Path(path)), vocab, seed)


def load_trace(path: str | Path, vocab: int, seed: int = 0) -> Workload:
    """A JSONL trace (see the module docstring): one stage, in arrival order."""
    rng = random.Random(seed)
    tokens = _Tokens(rng, vocab)
    prefixes: dict[str, list[int]] = {}
    out: list[SimRequest] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc.strerror}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(_trace_request(json.loads(line), tokens, prefixes))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise WorkloadError(f"{path}:{number}: not a trace request ({detail})") from exc
    if not out:
        raise WorkloadError(f"{path}: no requests")
    out.sort(key=lambda r: r.arrival)
    return Workload([Stage(out)], 0.0, {"trace": str(path)})


def _trace_request(
    item: dict[str, Any], tokens: _Tokens, prefixes: dict[str, list[int]]
) -> SimRequest:
    if not isinstance(item, dict):
        raise TypeError("a line is one JSON object")
    arrival, output = float(item["arrival"]), int(item["output_len"])
    if arrival < 0 or output < 0:
        raise ValueError("arrival and output_len must be >= 0")
    if "prompt_tokens" in item:
        prompt = [int(t) for t in item["prompt_tokens"]]
    else:
        length = int(item["prompt_len"])
        group = item.get("prefix_group")
        shared: list[int] = []
        if group is not None:
            shared_len = int(item.get("prefix_len", 0))
            shared = prefixes.setdefault(str(group), tokens.new(shared_len))[:shared_len]
            if len(shared) < shared_len:
                raise ValueError(f"prefix_len {shared_len} exceeds the group's first prefix")
        prompt = shared + tokens.new(max(0, length - len(shared)))
    if not prompt:
        raise ValueError("an empty prompt")
    return SimRequest(arrival, prompt, output)
