"""Long requests among short ones (the seed's second follow-up), measured with
``slotserve bench --preset long-among-short``: a few 2,000-token requests start at once, then a
Poisson stream of 20-token requests. The same short stream (same seed, same arrival times) runs
without the long requests, then with them; the short requests' TTFT percentiles are compared.

Server flags not known here are passed through, so the scheduling-policy issue can run
``python benchmarks/bench_long_short.py --policy ...`` unchanged.

Run: python benchmarks/bench_long_short.py [--chart docs/bench_long_short.png] [server flags]
"""

from __future__ import annotations

import argparse
from typing import Any

from _serve import bench, engine_commit, slotserve


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--long-requests", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--short-requests", type=int, default=200)
    parser.add_argument("--short-tokens", type=int, default=20)
    parser.add_argument("--rate", type=float, default=20.0, help="short requests/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chart", default=None, help="write a PNG here")
    args, server_flags = parser.parse_known_args()  # fmt: skip
    flags = ["--num-slots", str(args.slots), "--mock-step-ms", str(args.step_ms), *server_flags]
    print(
        f"engine commit {engine_commit()}; server flags {flags}; {args.short_requests} short "
        f"requests at {args.rate}/s, {args.long_requests} x {args.long_tokens} tokens"
    )
    runs: dict[str, dict[str, Any]] = {}
    with slotserve(*flags) as url:
        for label, longs in (("without long", 0), ("with long", args.long_requests)):
            runs[label] = bench(
                url, "--preset", "long-among-short", "--long-requests", str(longs),
                "--long-tokens", str(args.long_tokens), "--short-tokens", str(args.short_tokens),
                "--num-requests", str(args.short_requests + longs),
                "--request-rate", str(args.rate), "--seed", str(args.seed),
            )  # fmt: skip
    print(
        f"{'run':>13} {'short TTFT p50':>15} {'p90':>7} {'p99':>7} {'short E2EL p99':>15} "
        f"{'long E2EL':>10}"
    )
    for label, body in runs.items():
        groups = body.get("groups", {})
        short = groups.get("short", body)
        long_e2el = groups["long"]["e2el_ms"]["mean"] if "long" in groups else None
        t = short["ttft_ms"]
        shown = f"{long_e2el / 1000:>9.1f}s" if long_e2el else f"{'-':>10}"
        print(f"{label:>13} {t['p50']:>15.1f} {t['p90']:>7.1f} {t['p99']:>7.1f} "
              f"{short['e2el_ms']['p99']:>15.1f} {shown}")  # fmt: skip
    if args.chart:
        chart(args.chart, runs)


def chart(path: str, runs: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = ("p50", "p90", "p99")
    figure, axis = plt.subplots(figsize=(7, 4))
    for k, (label, body) in enumerate(runs.items()):
        short = body.get("groups", {}).get("short", body)
        xs = [i + (k - 0.5) * 0.4 for i in range(len(stats))]
        axis.bar(xs, [short["ttft_ms"][s] for s in stats], 0.4, label=label)
    axis.set_xticks(range(len(stats)), stats)
    axis.set_ylabel("short requests' TTFT (ms)")
    axis.set_title("20-token requests, with and without 2,000-token ones")
    axis.grid(alpha=0.3, axis="y")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
