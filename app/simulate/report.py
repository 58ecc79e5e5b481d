"""inference-perf's report files from a simulation, and a short table.

The files carry inference-perf's own keys (``load_summary``, ``successes.latency.
time_to_first_token.mean`` and so on; every summary has mean, min, p0.1 ... p99.9, max), so one
analysis reads a real run and a simulated one. Latencies are what the client would measure:

- TTFT: from sending to the first token; E2E (``request_latency``): to the response's end.
- The client's token timestamps (``Client``): inference-perf as of the shared measurements
  (February 2026) recorded one timestamp per SSE message, and against vLLM that came to about
  two per generated token, the second ~0 s after the first (its ITL median is 27 us and its
  TPOT half the decode step in every shared experiment), plus the usage message and
  ``[DONE]`` at the end. So TPOT = (end - first token) / (k * tokens + m - 1) and ITL's
  samples are the steps' gaps and the zeros. ``Client(1, 0)`` is an exact client.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.simulate.run import RequestRecord, StageRun

PERCENTILES = (0.1, 1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9)


@dataclass(frozen=True, slots=True)
class Client:
    """How the client timestamps a stream: ``per_token`` stamps per generated token and
    ``trailing`` more at the end (the usage message, ``[DONE]``)."""

    per_token: int = 2
    trailing: int = 2


MEASURED_CLIENT = Client()  # the client of the shared measurements (see the module docstring)
EXACT_CLIENT = Client(1, 0)


def _key(q: float) -> str:
    return "median" if q == 50 else f"p{q:g}"


def summarize(
    values: Sequence[float], weights: Sequence[int] | None = None
) -> dict[str, float] | None:
    """Mean, min, percentiles (linear interpolation, as numpy's default) and max; ``weights``:
    each value counted that many times. None for no values."""
    if weights is None:
        pairs = sorted((v, 1) for v in values)
    else:
        pairs = sorted((v, w) for v, w in zip(values, weights, strict=True) if w > 0)
    total = sum(w for _, w in pairs)
    if not total:
        return None
    # value i covers ranks cumulative[i-1] .. cumulative[i]-1
    cumulative = list(itertools.accumulate(w for _, w in pairs))

    def at(rank: int) -> float:
        return pairs[bisect.bisect_right(cumulative, rank)][0]

    out = {"mean": sum(v * w for v, w in pairs) / total, "min": pairs[0][0]}
    for q in PERCENTILES:
        rank = q / 100 * (total - 1)
        low = math.floor(rank)
        lo, hi = at(low), at(min(low + 1, total - 1))
        out[_key(q)] = lo + (hi - lo) * (rank - low)
    out["max"] = pairs[-1][0]
    return out


def _tpot(record: RequestRecord, client: Client) -> float | None:
    stamps = client.per_token * record.output_len + client.trailing
    if record.first_token is None or record.done is None or stamps < 2:
        return None
    end = record.done if client.trailing else record.last_token
    assert end is not None
    return (end - record.first_token) / (stamps - 1)


def stage_metrics(
    records: list[RequestRecord], runs: list[StageRun], client: Client
) -> dict[str, Any]:
    """One report (a stage's, or the summary's over ``runs``) in inference-perf's keys."""
    ok = [r for r in records if not r.failed and r.done is not None]
    failed = [r for r in records if r.failed]
    gaps = [g for run in runs for g in run.gaps]
    counts = [c for run in runs for c in run.counts]
    zeros = sum((client.per_token - 1) * r.output_len + max(0, client.trailing - 1) for r in ok)
    if client.trailing:
        gaps += [
            r.done - r.last_token for r in ok if r.done is not None and r.last_token is not None
        ]
        counts += [1] * len(ok)
    gaps.append(0.0)
    counts.append(zeros)
    tpots = [t for t in (_tpot(r, client) for r in ok) if t is not None]
    start = min((r.sent for r in records), default=0.0)
    end = max((r.done or r.sent for r in records), default=0.0)
    total_time = max(end - start, 1e-9)
    sent = [r.sent for r in records]
    send_duration = max(sent) - min(sent) if sent else 0.0
    prompt_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    load: dict[str, Any] = {
        "count": len(records),
        "schedule_delay": summarize([0.0] * len(records)),
    }
    if len(runs) == 1:
        load |= {
            "send_duration": send_duration,
            "requested_rate": runs[0].rate,
            "achieved_rate": len(records) / send_duration if send_duration else 0.0,
        }
    assert all(r.done is not None for r in ok)
    return {
        "load_summary": load,
        "successes": {
            "count": len(ok),
            "latency": {
                "request_latency": summarize([r.done - r.sent for r in ok]),  # type: ignore[operator]
                "normalized_time_per_output_token": summarize(
                    [(r.done - r.sent) / r.output_len if r.output_len else 0.0 for r in ok]  # type: ignore[operator]
                ),
                "time_per_output_token": summarize(tpots),
                "time_to_first_token": summarize([r.first_token - r.sent for r in ok]),  # type: ignore[operator]
                "inter_token_latency": summarize(gaps, counts) if ok else None,
            },
            "throughput": {
                "input_tokens_per_sec": prompt_tokens / total_time,
                "output_tokens_per_sec": output_tokens / total_time,
                "total_tokens_per_sec": (prompt_tokens + output_tokens) / total_time,
                "requests_per_sec": len(ok) / total_time,
            },
            "prompt_len": summarize([float(r.prompt_len) for r in ok]),
            "output_len": summarize([float(r.output_len) for r in ok]),
        },
        "failures": {
            "count": len(failed),
            "request_latency": summarize([(r.done or r.sent) - r.sent for r in failed]),
            "prompt_len": summarize([float(r.prompt_len) for r in failed]),
        },
    }


def reports(runs: list[StageRun], client: Client) -> dict[str, dict[str, Any]]:
    """File name -> report: one per stage and the summary."""
    out = {
        f"stage_{run.index}_lifecycle_metrics.json": stage_metrics(run.records, [run], client)
        for run in runs
    }
    everything = [r for run in runs for r in run.records]
    out["summary_lifecycle_metrics.json"] = stage_metrics(everything, runs, client)
    return out


def write_reports(files: dict[str, dict[str, Any]], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, report in files.items():
        (directory / name).write_text(json.dumps(report, indent=2) + "\n")


def table(files: dict[str, dict[str, Any]], runs: list[StageRun]) -> str:
    """A short text table: per stage, requests, failures, TTFT / TPOT / E2E mean and p90 (ms),
    output tokens/s, steps and preemptions."""
    lines = [
        f"{'stage':>5} {'rate':>6} {'ok':>6} {'fail':>5} {'TTFT ms':>15} {'TPOT ms':>13} "
        f"{'E2E s':>13} {'out tok/s':>9} {'steps':>7} {'preempt':>7}   (mean / p90)"
    ]
    for run in runs:
        report = files[f"stage_{run.index}_lifecycle_metrics.json"]
        ok = report["successes"]
        latency = ok["latency"]
        ttft, tpot, e2e = (
            _pair(latency[name], scale, digits)
            for name, scale, digits in (
                ("time_to_first_token", 1e3, 1),
                ("time_per_output_token", 1e3, 2),
                ("request_latency", 1, 2),
            )
        )
        lines.append(
            f"{run.index:>5} {run.rate:>6g} {ok['count']:>6} {report['failures']['count']:>5} "
            f"{ttft:>15} {tpot:>13} {e2e:>13} {ok['throughput']['output_tokens_per_sec']:>9.0f} "
            f"{run.steps:>7} {run.preemptions:>7}"
        )
    return "\n".join(lines)


def _pair(summary: dict[str, float] | None, scale: float, digits: int) -> str:
    if summary is None:
        return "-"
    return f"{summary['mean'] * scale:.{digits}f} / {summary['p90'] * scale:.{digits}f}"
