"""A run's report: a rich summary table, a JSON document and PNG charts.

The charts need matplotlib, from the ``bench`` extra; ``require_matplotlib()`` says in one
line how to install it, so the CLI can refuse ``--report`` before a run rather than after.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bench.client import RequestResult
from app.bench.metrics import Summary, request_times, rounded, summarize
from app.bench.runner import SATURATED, RunOutput

INSTALL_HINT = "--report needs matplotlib: pip install 'slotserve[bench]'"
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def groups_of(results: Sequence[RequestResult]) -> dict[str, list[RequestResult]]:
    """Results by workload group, in first-seen order."""
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(r.group, []).append(r)
    return groups


def summary_dict(summary: Summary) -> dict[str, Any]:
    """The JSON fields of one summary (the issue's names; latencies in ms)."""
    body: dict[str, Any] = {
        "requests": summary.requests,
        "completed": summary.completed,
        "cancelled": summary.cancelled,
        "failed": summary.failed,
        "duration_s": round(summary.duration_s, 4),
        "request_throughput": rounded(summary.request_throughput),
        "output_throughput": rounded(summary.output_throughput),
        "output_tokens": summary.output_tokens,
        "output_chunks": summary.output_chunks,
        "received_tokens": summary.received_tokens,
        "goodput": None if summary.goodput is None else rounded(summary.goodput),
    }
    for name in LATENCIES:
        body[name] = getattr(summary, name).as_dict()
    return body


def document(run: RunOutput, slo: Mapping[str, float], setup: Mapping[str, Any]) -> dict[str, Any]:
    """The whole JSON report: the summary's fields at the top level, then each group's, the
    server's token counter delta, the tool's CPU per worker, errors and server samples."""
    summary = summarize(run.results, run.duration_s, slo)
    body = summary_dict(summary)
    groups = groups_of(run.results)
    if len(groups) > 1:
        body["groups"] = {
            name: summary_dict(summarize(rs, run.duration_s, slo)) for name, rs in groups.items()
        }
    body |= {
        "partial": run.partial,
        "planned_requests": run.planned,
        "slo": dict(slo),
        "server_generation_tokens": run.server_tokens,
        "tool_cpu_per_worker": [round(share, 3) for share in run.worker_cpu],
        "tool_cpu_seconds": round(run.cpu_s, 3),
        "tool_saturated": run.saturated,
        "errors": summary.errors,
        "setup": dict(setup),
        "server_samples": [
            [round(s.at - run.started, 3), s.running, s.waiting, s.slots] for s in run.samples
        ],
    }
    return body


def write_json(path: Path, body: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2, allow_nan=False) + "\n")


def print_summary(console: Console, run: RunOutput, slo: Mapping[str, float]) -> None:
    """The summary table (a latency column per group when there are several) and notes."""
    groups = groups_of(run.results)
    columns = {"all": run.results} | (groups if len(groups) > 1 else {})
    summaries = {name: summarize(rs, run.duration_s, slo) for name, rs in columns.items()}
    title = "slotserve bench" + (" (partial)" if run.partial else "")
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for name in summaries:
        table.add_column(name, justify="right")
    for label, get in _rows(bool(slo)):
        table.add_row(label, *(get(s) for s in summaries.values()))
    console.print(table)
    whole = summaries["all"]
    if run.server_tokens is not None:
        console.print(
            f"tokens received {whole.received_tokens:,}; the server's "
            f"vllm:generation_tokens_total grew by {run.server_tokens:,.0f}"
            + (" (the rest went to the streams closed at the interrupt)" if run.partial else "")
        )
    cpu = ", ".join(f"{share:.0%}" for share in run.worker_cpu)
    console.print(f"tool CPU per worker (share of one core): {cpu}")
    if run.saturated:
        console.print(
            f"[bold yellow]warning:[/] a worker used over {SATURATED:.0%} of a core: "
            "the tool may be the bottleneck; add --workers"
        )
    for error, count in list(whole.errors.items())[:5]:
        console.print(f"[red]failed x{count}:[/] {error}")
    if run.monitor_error:
        console.print(f"note: {run.monitor_error}")


def _rows(with_slo: bool) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [
        ("requests completed", lambda s: f"{s.completed:,}"),
        ("cancelled / failed", lambda s: f"{s.cancelled:,} / {s.failed:,}"),
        ("duration (s)", lambda s: f"{s.duration_s:.2f}"),
        ("requests/s", lambda s: f"{s.request_throughput:,.2f}"),
        ("output tokens/s", lambda s: f"{s.output_throughput:,.0f}"),
    ]
    if with_slo:
        rows.append(("goodput (requests/s)", lambda s: f"{s.goodput or 0:,.2f}"))
    for name in LATENCIES:
        label = name.removesuffix("_ms").upper()
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{label} {stat} (ms)", _stat_cell(name, stat)))
    return rows


def _stat_cell(name: str, stat: str) -> Any:
    def cell(summary: Summary) -> str:
        value = getattr(getattr(summary, name), stat)
        return "-" if math.isnan(value) else f"{value:,.1f}"

    return cell


def require_matplotlib() -> None:
    """Raise ``ImportError`` with ``INSTALL_HINT`` if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None


def write_charts(
    directory: Path, run: RunOutput, title: str = "", slo: Mapping[str, float] | None = None
) -> list[Path]:
    """``latency_cdf.png`` (TTFT, TPOT, ITL, E2EL per group, each ``slo`` limit drawn as a
    dashed line, one legend) and, with samples, ``server_load.png`` (requests running and
    waiting over time). ``title`` (the run's details) heads both. Returns the paths."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "latency_cdf.png"]
    figure, axes = plt.subplots(1, 4, figsize=(16, 4.4))
    for group, results in groups_of(run.results).items():
        times = [t for r in results if r.status == "completed" and (t := request_times(r))]
        series = {
            "TTFT": [t.ttft for t in times],
            "TPOT": [t.tpot for t in times if t.tpot is not None],
            "ITL": [gap for t in times for gap in t.itls],
            "E2EL": [t.e2el for t in times],
        }
        for axis, values in zip(axes, series.values(), strict=True):
            ms = sorted(v * 1000 for v in values)
            if ms:
                ys = [(i + 1) / len(ms) for i in range(len(ms))]
                axis.step(ms, ys, where="post", label=group)
    for axis, label in zip(axes, ("TTFT", "TPOT", "ITL", "E2EL"), strict=True):
        limit = (slo or {}).get(f"{label.lower()}_ms")
        if limit is not None:
            axis.axvline(limit, color="red", linestyle="--", label=f"{label} SLO {limit:g} ms")
        axis.set_title(f"{label} CDF")
        axis.set_xlabel("ms")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    _one_legend(figure, axes)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(paths[0], dpi=100)
    plt.close(figure)
    if run.samples:
        paths.append(directory / "server_load.png")
        _load_chart(plt, run, paths[-1], title)
    return paths


def _one_legend(figure: Any, axes: Sequence[Any]) -> None:
    """One legend below the panels: every series once (the groups, then any SLO line)."""
    entries: dict[str, Any] = {}
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if entries:
        figure.legend(
            list(entries.values()), list(entries), loc="lower center", ncol=min(len(entries), 6)
        )


def chart_title(setup: Mapping[str, Any], run: RunOutput, when: str) -> str:
    """The run's details for a chart: model, server, load, requests and date."""
    rate = setup.get("request_rate")
    load = f"{rate:g} requests/s" if isinstance(rate, float) and math.isfinite(rate) else "burst"
    if setup.get("concurrency"):
        load += f", concurrency {setup['concurrency']}"
    requests = f"{len(run.results)} requests" + (
        f" of {run.planned} (partial)" if run.partial else ""
    )
    model = setup.get("model") or "the server's model"
    return f"{model} at {setup.get('url')} ({setup.get('api')} API): {load}, {requests}, {when}"


def _load_chart(plt: Any, run: RunOutput, path: Path, title: str) -> None:
    xs = [s.at - run.started for s in run.samples]
    figure, axis = plt.subplots(figsize=(8, 3.8))
    axis.plot(xs, [s.running for s in run.samples], label="running (slots occupied)")
    axis.plot(xs, [s.waiting for s in run.samples], label="waiting (queue)")
    slots = [s.slots for s in run.samples if s.slots is not None]
    if slots:
        axis.axhline(max(slots), color="grey", linestyle="--", label="slots")
    axis.set_xlabel("seconds since start")
    axis.set_ylabel("requests")
    axis.set_title(f"server load over the run\n{title}", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
