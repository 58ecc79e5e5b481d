"""Latency and throughput math with ``vllm bench serve``'s definitions (pure functions).

Per completed request, times in seconds from its send:
- TTFT: first chunk carrying output - send;
- E2EL: last chunk carrying output - send;
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one token;
- ITL: every gap between consecutive chunks, pooled over requests.
Over the run: request throughput = completed / duration, output throughput = output tokens of
completed requests / duration, goodput = completed requests meeting every SLO / duration.
Cancelled and failed requests are counted, not timed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from app.bench.client import RequestResult

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")


@dataclass(frozen=True, slots=True)
class Stats:
    """Milliseconds: mean and percentiles (NaN when there were no values)."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    def as_dict(self) -> dict[str, float | None]:
        return {name: rounded(getattr(self, name)) for name in ("mean", "p50", "p90", "p99")}


def rounded(x: float) -> float | None:
    """``x`` to 3 decimals for the JSON report (None for NaN: no value)."""
    return None if math.isnan(x) else round(x, 3)


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One completed request's latencies in seconds (``tpot`` None for a single token)."""

    ttft: float
    e2el: float
    tpot: float | None
    itls: list[float]
    tokens: int


@dataclass(frozen=True, slots=True)
class Summary:
    """A run's figures; latencies in milliseconds, throughputs per second of ``duration_s``."""

    requests: int
    completed: int
    cancelled: int
    failed: int
    duration_s: float
    output_tokens: int
    output_chunks: int  # reads that carried output, over completed requests
    received_tokens: int
    request_throughput: float
    output_throughput: float
    goodput: float | None
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    errors: dict[str, int] = field(default_factory=dict)


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) of sorted values, interpolated linearly between the
    closest ranks (numpy's default, which ``vllm bench serve`` uses); NaN if empty."""
    if not sorted_values:
        return math.nan
    rank = (len(sorted_values) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def stats_ms(values_s: Iterable[float]) -> Stats:
    """Mean, p50, p90 and p99 of seconds, in milliseconds."""
    ms = sorted(v * 1000.0 for v in values_s)
    mean = sum(ms) / len(ms) if ms else math.nan
    return Stats(mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), len(ms))


def request_times(result: RequestResult) -> RequestTimes | None:
    """The latencies of one request that received output; None if it received none."""
    if not result.chunks:
        return None
    ttft = result.chunks[0] - result.sent
    e2el = result.chunks[-1] - result.sent
    tpot = (e2el - ttft) / (result.tokens - 1) if result.tokens > 1 else None
    itls = [b - a for a, b in zip(result.chunks, result.chunks[1:], strict=False)]
    return RequestTimes(ttft, e2el, tpot, itls, result.tokens)


def meets(times: RequestTimes, slo: Mapping[str, float]) -> bool:
    """Whether a request meets every SLO given (milliseconds; a missing TPOT counts as 0)."""
    measured = {"ttft_ms": times.ttft, "tpot_ms": times.tpot or 0.0, "e2el_ms": times.e2el}
    return all(measured[key] * 1000.0 <= limit for key, limit in slo.items())


def summarize(
    results: Sequence[RequestResult], duration_s: float, slo: Mapping[str, float] | None = None
) -> Summary:
    """The run's figures over ``results`` (see the module docstring); ``goodput`` is None
    without an SLO."""
    completed = [r for r in results if r.status == "completed"]
    times = [t for t in map(request_times, completed) if t is not None]
    errors = dict(Counter(r.error or "unknown" for r in results if r.status == "failed"))
    output_tokens = sum(r.tokens for r in completed)
    rate = 1.0 / duration_s if duration_s > 0 else math.nan
    good = None if not slo else sum(meets(t, slo) for t in times) * rate
    return Summary(
        requests=len(results),
        completed=len(completed),
        cancelled=sum(r.status == "cancelled" for r in results),
        failed=sum(r.status == "failed" for r in results),
        duration_s=duration_s,
        output_tokens=output_tokens,
        output_chunks=sum(len(r.chunks) for r in completed),
        received_tokens=sum(r.tokens for r in results),
        request_throughput=len(completed) * rate,
        output_throughput=output_tokens * rate,
        goodput=good,
        ttft_ms=stats_ms(t.ttft for t in times),
        tpot_ms=stats_ms(t.tpot for t in times if t.tpot is not None),
        itl_ms=stats_ms(gap for t in times for gap in t.itls),
        e2el_ms=stats_ms(t.e2el for t in times),
        errors=errors,
    )


def parse_slo(text: str) -> dict[str, float]:
    """``ttft_ms=200,tpot_ms=50`` -> a dict; raises ValueError naming a bad key or value."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"{part!r}: expected KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"{part!r}: {value!r} is not a number of milliseconds") from None
        if not slo[key] > 0:
            raise ValueError(f"{part!r}: an SLO must be > 0 ms")
    return slo
