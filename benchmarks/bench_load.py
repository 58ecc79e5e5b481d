"""Latency under load, measured with ``slotserve bench``: Poisson arrivals at 0.25, 0.5, 0.75,
1.0 and 1.2 times the server's capacity; TTFT, TPOT and ITL percentiles per load.

Capacity is measured first: a closed loop with twice as many requests in flight as slots keeps
every slot busy, and its request throughput is the most the server can complete.

Run: python benchmarks/bench_load.py [--seconds 12] [--chart docs/bench_load.png]
     [any slotserve serve flag, passed through, e.g. --num-slots 16]
"""

from __future__ import annotations

import argparse
from typing import Any

from _serve import bench, engine_commit, slotserve

LOADS = (0.25, 0.5, 0.75, 1.0, 1.2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--output-len", default="64")
    parser.add_argument("--prompt-len", default="32")
    parser.add_argument("--seconds", type=float, default=12.0, help="arrivals per load level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chart", default=None, help="write a PNG here")
    args, server_flags = parser.parse_known_args()  # fmt: skip
    common = ["--prompt-len", args.prompt_len, "--output-len", args.output_len]
    flags = ["--num-slots", str(args.slots), "--mock-step-ms", str(args.step_ms),
             "--max-waiting", "100000", *server_flags]  # fmt: skip
    print(f"engine commit {engine_commit()}; server flags {flags}")
    with slotserve(*flags) as url:
        full = bench(url, *common, "--num-requests", str(args.slots * 8), "--concurrency",
                     str(args.slots * 2), "--warmup", str(args.slots))  # fmt: skip
        capacity = full["request_throughput"]
        print(f"capacity: {capacity:.1f} requests/s ({full['output_throughput']:,.0f} tokens/s)")
        rows = []
        for load in LOADS:
            rate = load * capacity
            n = max(20, round(rate * args.seconds))
            body = bench(url, *common, "--num-requests", str(n), "--request-rate", f"{rate:.3f}",
                         "--seed", str(args.seed))  # fmt: skip
            rows.append((load, rate, body))
    print(
        f"{'load':>5} {'req/s':>7} {'done/s':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
        f"{'TPOT p50':>9} {'p99':>6} {'ITL p50':>8} {'p99':>6} {'E2EL p50':>9} {'tool CPU':>8}"
    )
    for load, rate, body in rows:
        t, p, i, e = body["ttft_ms"], body["tpot_ms"], body["itl_ms"], body["e2el_ms"]
        print(f"{load:>5.2f} {rate:>7.1f} {body['request_throughput']:>7.1f} {t['p50']:>9.1f} "
              f"{t['p90']:>7.1f} {t['p99']:>7.1f} {p['p50']:>9.1f} {p['p99']:>6.1f} "
              f"{i['p50']:>8.1f} {i['p99']:>6.1f} {e['p50']:>9.1f} "
              f"{max(body['tool_cpu_per_worker']):>8.0%}")  # fmt: skip
    if args.chart:
        chart(args.chart, rows)


def chart(path: str, rows: list[tuple[float, float, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [load for load, _, _ in rows]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for axis, metric in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"), strict=True):
        for stat in ("p50", "p90", "p99"):
            axis.plot(loads, [body[metric][stat] for *_, body in rows], marker="o", label=stat)
        axis.set_title(metric.removesuffix("_ms").upper() + " vs load")
        axis.set_xlabel("offered load / capacity")
        axis.set_ylabel("ms")
        axis.set_yscale("log")
        axis.grid(alpha=0.3, which="both")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
