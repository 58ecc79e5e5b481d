"""The bench tool's own ceiling: how many SSE events per second one worker can read, measured
against ``baseline_sse.py`` (FastAPI + sse-starlette + uvicorn with no engine: a ticker hands
one token to every open stream every STEP_MS), a server that costs nearly nothing per event.

For each number of open streams it prints tokens/s received, the ideal (streams / step), the
tool's CPU share of one core per worker and its CPU microseconds per token. Reads merge
events when the tool falls behind, so the figure that bounds the tool is CPU per token at the
loads where it kept up.

Run: python benchmarks/bench_tool_ceiling.py [--baseline ../shared/bench] [--streams 50,100,200]
     [--workers 1,2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _serve import ROOT, bench, free_port, started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=ROOT.parent.parent / "shared" / "bench",
        help="folder of baseline_sse.py",
    )
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument(
        "--streams", type=lambda s: [int(x) for x in s.split(",")], default=[50, 100, 200]
    )
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--tokens", type=int, default=300, help="tokens per request")
    args = parser.parse_args()  # fmt: skip
    if not (args.baseline / "baseline_sse.py").exists():
        raise SystemExit(f"no baseline_sse.py in {args.baseline} (pass --baseline DIR)")
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "baseline_sse:app", "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
    env = {"STEP_MS": str(args.step_ms)}
    print(
        f"{'streams':>7} {'workers':>7} {'tokens/s':>9} {'ideal':>7} {'tokens/read':>11} "
        f"{'tool CPU/worker':>16} {'us CPU/token':>12}"
    )
    with started(command, port, cwd=args.baseline, env=env) as url:
        for streams in args.streams:
            for workers in args.workers:
                body = bench(url, "--monitor", "off", "--num-requests", str(streams * 2),
                             "--concurrency", str(streams), "--output-len", str(args.tokens),
                             "--workers", str(workers), "--warmup", str(streams))  # fmt: skip
                tokens = body["received_tokens"]
                per_token = body["tool_cpu_seconds"] / tokens * 1e6
                ideal = streams / (args.step_ms / 1000)
                reads = body["output_tokens"] / max(1, body["output_chunks"])
                cpu = " ".join(f"{c:.0%}" for c in body["tool_cpu_per_worker"])
                print(f"{streams:>7} {workers:>7} {body['output_throughput']:>9,.0f} "
                      f"{ideal:>7,.0f} {reads:>11.2f} {cpu:>16} {per_token:>12.1f}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
