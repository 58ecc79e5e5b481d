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

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app import checks

BLOCK = 16  # tokens that make a prompt unique: its first block differs from every other's
# Bounds of what a workload may ask for (a bigger one is refused with a WorkloadError naming
# the field, before anything is allocated):
MAX_REQUESTS = 2_000_000  # requests of one simulation (every stage, or a trace's lines)
MAX_SECONDS = 30 * 86_400  # a stage's duration, a trace's arrival time (30 days)
MAX_REQUEST_TOKENS = 1 << 21  # one request's prompt or output length (2,097,152 tokens)
MAX_WORKLOAD_TOKENS = 1 << 28  # prompt tokens a workload makes in all (~2 GiB of token ids)
MAX_RATE = 1e6  # requests per second of a stage


class WorkloadError(ValueError):
    """An inference-perf config or trace ``simulate`` cannot replay (names what and where)."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request: sent at ``arrival`` (seconds from the start of its stage); ``priority``
    and ``user`` as the scheduling policies read them. ``refused_len``: the prompt length of
    a request longer than the server's max_model_len (its tokens are not made: the server
    refuses it, as vLLM does, and the replay counts a failure); 0 otherwise."""

    arrival: float
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    user: str | None = None
    refused_len: int = 0

    @property
    def prompt_len(self) -> int:
        return self.refused_len or len(self.prompt)


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


# A prompt ready to send: its tokens, max_tokens, and its length if it is refused (too long).
Prompt = tuple[list[int], int, int]


# --- lengths and arrival times ---------------------------------------------------------------


def _length(value: Any, what: str, minimum: int = 0) -> int:
    return checks.integer(value, what, WorkloadError, minimum=minimum, maximum=MAX_REQUEST_TOKENS)


def _lengths(rng: random.Random, spec: Any, count: int, what: str, minimum: int = 0) -> list[int]:
    """``count`` lengths (each ``>= minimum``): a fixed int, or a distribution {min, max, mean,
    std_dev} (a normal, clipped and rounded, as inference-perf draws them)."""
    if not isinstance(spec, dict):
        return [_length(spec, what, minimum)] * count
    try:
        low = _length(spec["min"], f"{what}.min", minimum)
        high = _length(spec["max"], f"{what}.max", minimum)
        mean = checks.number(spec["mean"], f"{what}.mean", WorkloadError)
    except KeyError as exc:
        raise WorkloadError(f"{what}: a distribution needs min, max, mean (and std_dev)") from exc
    std = checks.number(spec.get("std_dev", 0.0), f"{what}.std_dev", WorkloadError, minimum=0)
    if not low <= mean <= high:
        raise WorkloadError(f"{what}: needs min <= mean <= max, got {low}, {mean}, {high}")
    return [
        int(min(high, max(low, round(rng.gauss(mean, std) if std else mean)))) for _ in range(count)
    ]


def _spread(rng: random.Random, count: int, start: float, duration: float) -> list[float]:
    """``count`` times over ``[start, start + duration]``: exponential gaps scaled so that they
    add up to ``duration`` (inference-perf's constant load)."""
    gaps = [rng.expovariate(1.0) for _ in range(count)]
    scale = duration / sum(gaps) if count else 0.0
    return list(itertools.accumulate((gap * scale for gap in gaps), initial=start))[1:]


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
    """A stage's arrival times; ``rate`` and ``duration`` finite and positive (the caller
    bounds ``rate * duration``)."""
    if kind == "constant":
        return _spread(rng, int(rate * duration), 0.0, duration)
    times: list[float] = []
    for second in range(math.ceil(duration)):
        times += _spread(rng, _poisson(rng, rate), float(second), 1.0)
    return [t for t in times if t <= duration]


# --- prompts ---------------------------------------------------------------------------------


class _Tokens:
    """Random token ids: a prompt of ``n`` new tokens is a unique first block and then a shared
    filler (block hashes chain, so every block of it is new to the prefix cache). Counts the
    tokens the workload's prompts hold: past ``MAX_WORKLOAD_TOKENS``, a ``WorkloadError``."""

    def __init__(self, rng: random.Random, vocab: int) -> None:
        self.rng, self.vocab = rng, vocab
        self._filler: list[int] = []
        self.made = 0

    def charge(self, n: int, what: str) -> None:
        """Count ``n`` more prompt tokens (before they are allocated)."""
        self.made += n
        if self.made > MAX_WORKLOAD_TOKENS:
            raise WorkloadError(
                f"{what}: the workload's prompts exceed {MAX_WORKLOAD_TOKENS} tokens in all "
                "(simulate's bound): fewer or shorter requests"
            )

    def new(self, n: int, what: str) -> list[int]:
        self.charge(n, what)
        head = [self.rng.randrange(self.vocab) for _ in range(min(n, BLOCK))]
        rest = n - len(head)
        while len(self._filler) < rest:
            self._filler += [self.rng.randrange(self.vocab) for _ in range(4096)]
        return head + self._filler[:rest]


def _fits(prompt_len: int, output_len: int, max_len: int | None) -> bool:
    return max_len is None or prompt_len + output_len <= max_len


def _shared_prefix(
    spec: Any, rng: random.Random, tokens: _Tokens, max_len: int | None
) -> Iterator[Prompt]:
    where = "data.shared_prefix"
    if not isinstance(spec, dict):
        raise WorkloadError(f"{where}: missing (the shared_prefix data's settings)")
    try:
        raw = spec["num_groups"], spec["num_prompts_per_group"], spec["system_prompt_len"]
    except KeyError as exc:
        raise WorkloadError(f"{where}: missing {exc}") from exc
    groups = checks.integer(raw[0], f"{where}.num_groups", WorkloadError, minimum=1,
                            maximum=MAX_REQUESTS)  # fmt: skip
    per_group = checks.integer(raw[1], f"{where}.num_prompts_per_group", WorkloadError,
                               minimum=1, maximum=MAX_REQUESTS)  # fmt: skip
    if groups * per_group > MAX_REQUESTS:
        raise WorkloadError(
            f"{where}: num_groups x num_prompts_per_group ({groups * per_group}) exceeds "
            f"{MAX_REQUESTS} prompts (simulate's bound)"
        )
    system_len = _length(raw[2], f"{where}.system_prompt_len")
    question = spec.get("question_distribution") or spec.get("question_len")
    output = spec.get("output_distribution") or spec.get("output_len")
    prompts: list[Prompt] = []
    for _ in range(groups):  # (the random draws in inference-perf's order: system, lengths)
        fits_one = _fits(system_len, 1, max_len)  # else no prompt of the group fits
        system = tokens.new(system_len, f"{where}.system_prompt_len") if fits_one else []
        questions = _lengths(rng, question, per_group, f"{where}.question_len",
                             0 if system_len else 1)  # fmt: skip
        outputs = _lengths(rng, output, per_group, f"{where}.output_len", 1)
        for q, o in zip(questions, outputs, strict=True):
            if _fits(system_len + q, o, max_len):
                tokens.charge(system_len, f"{where}.system_prompt_len")  # the copy below
                prompts.append((system + tokens.new(q, f"{where}.question_len"), o, 0))
            else:
                prompts.append(([], o, system_len + q))
    rng.shuffle(prompts)
    yield from itertools.cycle(prompts)


def _random(
    config: dict[str, Any], rng: random.Random, tokens: _Tokens, max_len: int | None
) -> Iterator[Prompt]:
    dists = {}
    for name, minimum in (("input_distribution", 1), ("output_distribution", 1)):
        dist = config.get(name)
        if not isinstance(dist, dict):
            raise WorkloadError(f"data.{name}: missing (random data needs it)")
        count = dist.get("total_count")
        count = 1000 if count is None else count
        count = checks.integer(count, f"data.{name}.total_count", WorkloadError, minimum=1,
                               maximum=MAX_REQUESTS)  # fmt: skip
        dists[name] = _lengths(rng, dist, count, f"data.{name}", minimum)
    inputs, outputs = dists["input_distribution"], dists["output_distribution"]
    for length, output in zip(itertools.cycle(inputs), itertools.cycle(outputs), strict=False):
        if _fits(length, output, max_len):
            yield tokens.new(length, "data.input_distribution"), output, 0
        else:
            yield [], output, length


def _data(
    config: dict[str, Any], rng: random.Random, vocab: int, max_len: int | None
) -> Iterator[Prompt]:
    """The prompts of request 0, 1, 2, ... for the ``data`` section."""
    kind = config.get("type")
    tokens = _Tokens(rng, vocab)
    if kind == "shared_prefix":
        return _shared_prefix(config.get("shared_prefix"), rng, tokens, max_len)
    if kind == "random":
        return _random(config, rng, tokens, max_len)
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


def from_inference_perf(
    config: dict[str, Any], vocab: int, seed: int = 0, max_len: int | None = None
) -> Workload:
    """The workload of an inference-perf config (its ``data`` and ``load`` sections); a
    request longer than ``max_len`` (prompt and output) is made with no tokens and
    ``refused_len`` set. ``WorkloadError`` names a bad or unsupported field, or a bound of
    this module exceeded."""
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
    interval = load.get("interval")
    interval = 1.0 if interval is None else checks.positive(
        interval, "load.interval", WorkloadError, MAX_SECONDS
    )  # fmt: skip
    rng = random.Random(seed)
    requests = _data(data, rng, vocab, max_len)
    stages: list[Stage] = []
    total = 0
    for i, spec in enumerate(stages_spec):
        where = f"load.stages[{i}]"
        if not isinstance(spec, dict) or "rate" not in spec or "duration" not in spec:
            raise WorkloadError(f"{where}: needs a rate and a duration")
        rate = checks.positive(spec["rate"], f"{where}.rate", WorkloadError, MAX_RATE)
        duration = checks.positive(spec["duration"], f"{where}.duration", WorkloadError,
                                   MAX_SECONDS)  # fmt: skip
        total += math.ceil(rate * duration)
        if total > MAX_REQUESTS:
            raise WorkloadError(
                f"{where}: rate x duration brings the requests to {total}, more than "
                f"{MAX_REQUESTS} (simulate's bound): a lower rate or a shorter duration"
            )
        times = arrival_times(rng, kind, rate, duration)
        made = zip(times, requests, strict=False)  # (requests never ends)
        stage = [SimRequest(t, prompt, out, refused_len=refused)
                 for t, (prompt, out, refused) in made]  # fmt: skip
        stages.append(Stage(stage, rate, duration))
    return Workload(stages, interval, config)


def load_inference_perf(
    path: str | Path, vocab: int, seed: int = 0, max_len: int | None = None
) -> Workload:
    return from_inference_perf(_read_config(Path(path)), vocab, seed, max_len)


def load_trace(path: str | Path, vocab: int, seed: int = 0, max_len: int | None = None) -> Workload:
    """A JSONL trace (see the module docstring): one stage, in arrival order. A request
    longer than ``max_len`` is made as ``from_inference_perf`` makes it; a line that does not
    parse, or a field of the wrong type or out of range, is a ``WorkloadError`` naming the
    line and the field."""
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
        if len(out) >= MAX_REQUESTS:
            raise WorkloadError(f"{path}:{number}: more than {MAX_REQUESTS} requests")
        try:
            item = json.loads(line)
            out.append(_trace_request(item, tokens, prefixes, max_len))
        except WorkloadError as exc:
            raise WorkloadError(f"{path}:{number}: {exc}") from exc
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise WorkloadError(f"{path}:{number}: not a trace request ({detail})") from exc
    if not out:
        raise WorkloadError(f"{path}: no requests")
    out.sort(key=lambda r: r.arrival)
    return Workload([Stage(out)], 0.0, {"trace": str(path)})


def _trace_request(
    item: Any, tokens: _Tokens, prefixes: dict[str, list[int]], max_len: int | None
) -> SimRequest:
    if not isinstance(item, dict):
        raise TypeError("a line is one JSON object")
    arrival = checks.number(item["arrival"], "arrival", WorkloadError, minimum=0,
                            maximum=MAX_SECONDS)  # fmt: skip
    output = _length(item["output_len"], "output_len", 1)
    if "prompt_tokens" in item:
        ids = item["prompt_tokens"]
        if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_REQUEST_TOKENS:
            raise WorkloadError(
                f"prompt_tokens must be a list of 1 to {MAX_REQUEST_TOKENS} token ids"
            )
        tokens.charge(len(ids), "prompt_tokens")
        prompt = [checks.integer(t, "prompt_tokens[]", WorkloadError, minimum=0) for t in ids]
        if not _fits(len(prompt), output, max_len):
            return SimRequest(arrival, [], output, refused_len=len(prompt))
        return SimRequest(arrival, prompt, output)
    length = _length(item["prompt_len"], "prompt_len", 1)
    if not _fits(length, output, max_len):
        return SimRequest(arrival, [], output, refused_len=length)
    group = item.get("prefix_group")
    shared: list[int] = []
    if group is not None:
        if not isinstance(group, str):
            raise WorkloadError(f"prefix_group must be a string, got {group!r}")
        shared_len = checks.integer(item.get("prefix_len", 0), "prefix_len", WorkloadError,
                                    minimum=0, maximum=length)  # fmt: skip
        if group not in prefixes:
            prefixes[group] = tokens.new(shared_len, "prefix_len")
        shared = prefixes[group][:shared_len]
        if len(shared) < shared_len:
            raise WorkloadError(f"prefix_len {shared_len} exceeds the group's first prefix")
        tokens.charge(shared_len, "prefix_len")  # the copy below
    return SimRequest(arrival, shared + tokens.new(length - len(shared), "prompt_len"), output)
