"""``slotserve bench`` (also ``python -m app bench``): load-test a server and report.

Exit status: 0 after a run with at least one request that did not fail, 1 if the server is
unreachable or every request failed, 2 for bad arguments. Errors are one line, never a
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from app.bench import report, workload
from app.bench.client import RequestResult
from app.bench.metrics import parse_slo
from app.bench.runner import BenchError, Interrupted, RunConfig, RunOutput, run
from app.bench.workload import WorkloadConfig

PROGRESS_LINE_S = 5.0  # seconds between progress lines when stderr is not a terminal


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none (None, False, empty) or its help already
    names it (also used by ``slotserve simulate``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, "", []) or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="slotserve bench",
        description="Load-test a slotserve server (native /generate) or any OpenAI-compatible "
        "server (--api openai) and report TTFT, TPOT, ITL and E2EL as vllm bench serve does.",
        formatter_class=DefaultsFormatter,
    )
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="server base URL")
    add(
        "--api",
        choices=("native", "openai"),
        default="native",
        help="native: POST /generate; openai: POST /v1/completions (vLLM, TGI, llama.cpp)",
    )
    add("--model", default=None, help="model name sent with --api openai")
    add("--num-requests", type=int, default=200, help="requests measured")
    add(
        "--concurrency",
        type=int,
        default=None,
        help="most requests in flight (with the default rate: a closed loop)",
    )
    add(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, Poisson arrivals (inf: all at once)",
    )
    add(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 is Poisson, < 1 burstier",
    )
    add("--warmup", type=int, default=0, help="requests sent first and not counted")
    add("--seed", type=int, default=0, help="workload seed")
    add("--prompt-len", default="32", help="prompt tokens: N, uniform:LO:HI or exp:MEAN:CAP")
    add(
        "--output-len",
        default="128",
        help="max_tokens: N, uniform:LO:HI or exp:MEAN:CAP (Anyscale: exp:128:512)",
    )
    add(
        "--preset",
        choices=workload.PRESETS,
        default=None,
        help="long-among-short: --long-requests of --long-tokens at t=0, then short ones "
        "at --request-rate",
    )
    add("--long-requests", type=int, default=4, help="long-among-short: long requests")
    add("--long-tokens", type=int, default=2000, help="long-among-short: long output")
    add("--short-tokens", type=int, default=20, help="long-among-short: short output")
    add(
        "--cancel-rate",
        type=float,
        default=0.0,
        help="fraction of requests cancelled (connection closed) after a random token count",
    )
    add(
        "--respect-eos",
        action="store_true",
        help="let the model stop early (default: ignore_eos, exact output lengths)",
    )
    add(
        "--temperature",
        type=float,
        default=None,
        help="temperature sent with every request (unset: the server's default)",
    )
    add("--slo", default="", help="goodput SLOs in ms, e.g. ttft_ms=500,tpot_ms=50")
    add("--api-key", default=None, help="bearer token (default: $SLOTSERVE_API_KEY)")
    add("--header", action="append", default=[], metavar="K=V", help="extra header (repeat)")
    add("--workers", type=int, default=1, help="load-generating processes")
    add(
        "--monitor",
        choices=("auto", "slots", "metrics", "off"),
        default="auto",
        help="poll the server's load from /slots or /metrics (auto: /slots for native)",
    )
    add("--monitor-interval", type=float, default=0.25, help="seconds between polls")
    add("--timeout", type=float, default=300.0, help="seconds a stream may go without bytes")
    add("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")
    add("--report", type=Path, default=None, metavar="DIR", help="write PNG charts here")
    add(
        "--no-progress",
        action="store_true",
        help="no progress (a live bar on a terminal, else a line every few seconds)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, specs, warmup, slo = _setup(args)
        if args.report is not None:
            report.require_matplotlib()
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    console = Console(stderr=True)
    try:
        output = _run_with_progress(config, specs, warmup, console, args.no_progress)
    except BenchError as err:
        print(f"slotserve bench: error: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted):
        print("slotserve bench: interrupted before any request was measured", file=sys.stderr)
        return 130
    if output.partial:
        print(
            f"slotserve bench: interrupted: reporting the {len(output.results)} of "
            f"{output.planned} requests that ended (partial)",
            file=sys.stderr,
        )
    try:
        status = _report(args, output, slo, console)
    except KeyboardInterrupt:  # Ctrl-C again while the charts are drawn: what is written stays
        print("slotserve bench: interrupted while writing the report", file=sys.stderr)
        return 130
    return 130 if output.partial else status


def _setup(
    args: argparse.Namespace,
) -> tuple[RunConfig, list[workload.RequestSpec], list[workload.RequestSpec], dict[str, float]]:
    for flag in ("concurrency", "workers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    if args.warmup < 0 or args.timeout <= 0 or args.monitor_interval <= 0:
        raise ValueError("--warmup must be >= 0; --timeout and --monitor-interval > 0")
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    # every field of the workload is the flag of its name; the lengths parsed
    fields = {field.name: getattr(args, field.name) for field in dataclasses.fields(WorkloadConfig)}
    lengths = {name: workload.parse_lengths(fields[name]) for name in ("prompt_len", "output_len")}
    base = WorkloadConfig(**(fields | lengths))
    specs = workload.build(base)
    warmup = []
    if args.warmup:
        warm = WorkloadConfig(args.warmup, base.prompt_len, base.output_len, seed=args.seed + 1)
        warmup = workload.build(warm)
    headers = [_header(h) for h in args.header]
    api_key = args.api_key or os.environ.get("SLOTSERVE_API_KEY")  # never shown in --help
    if api_key:
        headers.append(("Authorization", f"Bearer {api_key}"))
    monitor = {"auto": "slots" if args.api == "native" else "metrics", "off": None}
    config = RunConfig(
        url=args.url.rstrip("/"),
        api=args.api,
        model=args.model,
        headers=tuple(headers),
        concurrency=args.concurrency,
        workers=args.workers,
        ignore_eos=not args.respect_eos,
        temperature=args.temperature,
        timeout_s=args.timeout,
        monitor=monitor.get(args.monitor, args.monitor),  # type: ignore[arg-type]
        monitor_interval_s=args.monitor_interval,
    )
    return config, specs, warmup, parse_slo(args.slo)


def _plain(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (int, str, bool))


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--header needs K=V, got {text!r}")
    return key.strip(), value


def _run_with_progress(
    config: RunConfig,
    specs: list[workload.RequestSpec],
    warmup: list[workload.RequestSpec],
    console: Console,
    quiet: bool,
) -> RunOutput:
    bar = Progress(
        TextColumn("requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        console=console,
        auto_refresh=False,
        transient=True,
        disable=quiet or not console.is_terminal,
    )
    task = bar.add_task("requests", total=len(specs), failed=0)
    lines = not quiet and not console.is_terminal  # a log file gets a line every few seconds
    failed, done, began = 0, 0, time.monotonic()
    shown = began

    def advance(result: RequestResult) -> None:  # no refresh thread: workers are forked
        nonlocal failed, done, shown
        failed += result.status == "failed"
        done += 1
        bar.update(task, advance=1, failed=failed)
        now = time.monotonic()
        if lines and now - shown >= PROGRESS_LINE_S:
            print(
                f"slotserve bench: {done}/{len(specs)} requests ended, {failed} failed, "
                f"{now - began:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            shown = now
        elif not lines and now - shown > 0.1:
            bar.refresh()
            shown = now

    with bar:
        return run(config, specs, warmup, advance)


def _report(
    args: argparse.Namespace, output: RunOutput, slo: dict[str, float], console: Console
) -> int:
    report.print_summary(Console(), output, slo)
    hidden = ("api_key", "json", "report", "header")
    setup = {k: v if _plain(v) else str(v) for k, v in vars(args).items() if k not in hidden}
    if args.json is not None:
        report.write_json(args.json, report.document(output, slo, setup))
        console.print(f"wrote {args.json}")
    if args.report is not None:
        when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        title = report.chart_title(setup, output, when)
        for path in report.write_charts(args.report, output, title, slo):
            console.print(f"wrote {path}")
    ok = sum(r.status != "failed" for r in output.results)
    return 0 if ok else 1
