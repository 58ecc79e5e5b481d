"""What the load generator sends: length distributions, request specs, arrival times, presets.

Everything is drawn from one ``random.Random(seed)``, so a seed gives the same workload on every
run and in every process (benchmark scripts rebuild it to compute a schedule's ideal).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

PRESETS = ("long-among-short",)


class WorkloadError(ValueError):
    """A workload description that cannot be used (the message names the problem)."""


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length distribution: ``fixed`` (``low``), ``uniform`` (``low``..``high`` inclusive) or
    ``exp`` (exponential with mean ``low``, capped at ``high``, at least 1: Anyscale's recipe)."""

    kind: str
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return min(self.high, max(1, round(rng.expovariate(1.0 / self.low))))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        return f"{self.kind}:{self.low}:{self.high}"


def parse_lengths(text: str) -> Lengths:
    """``N`` (fixed), ``uniform:LO:HI`` or ``exp:MEAN:CAP``; raises ``WorkloadError``."""
    parts = text.strip().split(":")
    try:
        numbers = [int(p) for p in parts[1:]] if len(parts) > 1 else [int(parts[0])]
    except ValueError:
        raise WorkloadError(f"{text!r} is not N, uniform:LO:HI or exp:MEAN:CAP") from None
    if len(parts) == 1:
        if numbers[0] < 0:
            raise WorkloadError(f"a length must be >= 0, got {text!r}")
        return Lengths("fixed", numbers[0], numbers[0])
    kind = parts[0]
    if kind not in ("uniform", "exp") or len(numbers) != 2:
        raise WorkloadError(f"{text!r} is not N, uniform:LO:HI or exp:MEAN:CAP")
    low, high = numbers
    if kind == "uniform" and not 0 <= low <= high:
        raise WorkloadError(f"uniform needs 0 <= LO <= HI, got {text!r}")
    if kind == "exp" and not (low >= 1 and high >= 1):
        raise WorkloadError(f"exp needs MEAN >= 1 and CAP >= 1, got {text!r}")
    return Lengths(kind, low, high)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: its index (send order), prompt token ids, output length, when to send it
    (seconds after the start), after how many received tokens to cancel it (None: never) and
    its group (``all``, or ``long``/``short`` in the long-among-short preset)."""

    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    send_at: float
    cancel_after: int | None = None
    group: str = "all"


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """How to build the request list. ``request_rate`` is requests/s (``inf``: all at once);
    ``burstiness`` is the gamma shape of the gaps (1: Poisson). The preset ``long-among-short``
    sends ``long_requests`` requests of ``long_tokens`` first, at time 0, then the rest as
    ``short_tokens``-token requests arriving at ``request_rate``."""

    num_requests: int
    prompt_len: Lengths
    output_len: Lengths
    request_rate: float = math.inf
    burstiness: float = 1.0
    cancel_rate: float = 0.0
    seed: int = 0
    preset: str | None = None
    long_requests: int = 4
    long_tokens: int = 2000
    short_tokens: int = 20


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send offsets (seconds) of ``n`` requests: gaps drawn from a gamma distribution with
    shape ``burstiness`` and mean ``1 / rate`` (as ``vllm bench serve``); all 0 if the rate is
    infinite. The first request goes at 0."""
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = (rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n - 1))
    return list(itertools.accumulate(gaps, initial=0.0))


def build(config: WorkloadConfig) -> list[RequestSpec]:
    """The requests of ``config``, in send order (``send_at`` never decreases)."""
    _check(config)
    rng = random.Random(config.seed)
    n_long = min(config.long_requests, config.num_requests) if config.preset else 0
    times = [0.0] * n_long
    times += arrival_times(
        config.num_requests - n_long, config.request_rate, config.burstiness, rng
    )
    specs = []
    for index, send_at in enumerate(times):
        is_long = index < n_long
        if config.preset:
            group = "long" if is_long else "short"
            max_tokens = config.long_tokens if is_long else config.short_tokens
        else:
            group, max_tokens = "all", config.output_len.draw(rng)
        prompt = tuple(rng.randrange(256) for _ in range(max(1, config.prompt_len.draw(rng))))
        cancel_after = None
        if config.cancel_rate and rng.random() < config.cancel_rate and max_tokens >= 2:
            cancel_after = rng.randint(1, max_tokens - 1)
        specs.append(RequestSpec(index, prompt, max_tokens, send_at, cancel_after, group))
    return specs


def _check(config: WorkloadConfig) -> None:
    if config.num_requests < 1:
        raise WorkloadError(f"--num-requests must be >= 1, got {config.num_requests}")
    if not config.request_rate > 0:
        raise WorkloadError(f"--request-rate must be > 0 (or inf), got {config.request_rate}")
    if not config.burstiness > 0:
        raise WorkloadError(f"--burstiness must be > 0, got {config.burstiness}")
    if not 0 <= config.cancel_rate <= 1:
        raise WorkloadError(f"--cancel-rate must be within 0..1, got {config.cancel_rate}")
    if config.preset is not None and config.preset not in PRESETS:
        raise WorkloadError(f"unknown preset {config.preset!r} (known: {', '.join(PRESETS)})")
