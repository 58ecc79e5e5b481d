"""Continuous vs static batching over HTTP, Anyscale's recipe, measured with ``slotserve bench``.

1,000 requests sent at once to a server with 32 slots and a 6 ms mock step; output lengths
exponential with mean 128, capped at 32 / 128 / 512 / 1536; the stop token ignored. Two
servers (``--batching continuous`` and ``static``) run the same seeded workload. For each cap it
prints output tokens/s of both, their ratio, the schedule's limit for that ratio (static steps /
continuous steps for the sampled lengths, ``app/bench/schedule.py``), and efficiency =
achieved / ideal tokens/s (ideal: the schedule's steps at exactly one step time each). The
server's ``slotserve:step_duration_seconds`` count and sum split the efficiency in two: steps
taken against the schedule's steps, and the mean step against the nominal step time. The step
ratio (static steps taken / continuous steps taken) is the ratio with the step time factored
out: on a machine whose load changes from run to run, it shows what the scheduler achieved.

Run: python benchmarks/bench_batching.py [--num-requests 1000] [--caps 32,128,512,1536]
     [--chart docs/bench_batching.png] [any slotserve serve flag, passed through]
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx
from _serve import bench, engine_commit, slotserve

from app.bench.monitor import parse_prometheus
from app.bench.schedule import continuous_steps, static_steps
from app.bench.workload import WorkloadConfig, build, parse_lengths

PROMPT = "8"
STEPS = "slotserve:step_duration_seconds_count"
STEP_SECONDS = "slotserve:step_duration_seconds_sum"


def step_books(url: str) -> dict[str, float]:
    """The server's decode steps so far and the seconds they took."""
    return parse_prometheus(httpx.get(url + "/metrics").text, {STEPS, STEP_SECONDS})


def lengths(n: int, cap: int, mean: int, seed: int) -> list[int]:
    """The output lengths the bench tool draws for the same flags (same seed, same order)."""
    config = WorkloadConfig(n, parse_lengths(PROMPT), parse_lengths(f"exp:{mean}:{cap}"),
                            seed=seed)  # fmt: skip
    return [spec.max_tokens for spec in build(config)]


def measure(args: argparse.Namespace, server_flags: list[str]) -> dict[str, dict[int, Any]]:
    """Both servers run at once (an idle one costs nothing) and each cap is measured on one
    then the other, so the machine's noise hits both alike."""
    results: dict[str, dict[int, Any]] = {"continuous": {}, "static": {}}

    def flags(policy: str) -> list[str]:
        return ["--num-slots", str(args.slots), "--mock-step-ms", str(args.step_ms),
                "--batching", policy, "--max-waiting", str(args.num_requests + 100),
                *server_flags]  # fmt: skip

    with slotserve(*flags("continuous")) as cont_url, slotserve(*flags("static")) as static_url:
        for cap in args.caps:
            for policy, url in (("continuous", cont_url), ("static", static_url)):
                before = step_books(url)
                body = bench(url, "--num-requests", str(args.num_requests), "--prompt-len",
                             PROMPT, "--output-len", f"exp:{args.mean}:{cap}", "--seed",
                             str(args.seed), "--workers", str(args.workers))  # fmt: skip
                after = step_books(url)
                body["steps"] = after[STEPS] - before[STEPS]
                body["step_s"] = (after[STEP_SECONDS] - before[STEP_SECONDS]) / body["steps"]
                results[policy][cap] = body
                print(f"  {policy:>10} cap {cap:>5}: {body['output_throughput']:>9,.0f} "
                      f"tokens/s in {body['duration_s']:.1f} s, {body['steps']:.0f} steps of "
                      f"{body['step_s'] * 1000:.1f} ms, tool CPU {body['tool_cpu_per_worker']}",
                      flush=True)  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument(
        "--caps", type=lambda s: [int(c) for c in s.split(",")], default=[32, 128, 512, 1536]
    )
    parser.add_argument("--mean", type=int, default=128)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="bench tool processes")
    parser.add_argument("--chart", default=None, help="write a PNG here")
    args, server_flags = parser.parse_known_args()  # fmt: skip
    print(
        f"engine commit {engine_commit()}; {args.num_requests} requests at once, "
        f"{args.slots} slots, {args.step_ms} ms step, server flags {server_flags}"
    )
    results = measure(args, server_flags)
    print(f"{'cap':>5} {'mean':>6} {'cont tok/s':>11} {'static tok/s':>12} {'ratio':>6} "
          f"{'limit':>6} {'of limit':>8} {'cont eff':>8} {'static eff':>10} "
          f"{'cont steps':>15} {'static steps':>15} {'step ms c/s':>12} "
          f"{'step ratio':>10} {'of limit':>8}")  # fmt: skip
    rows = []
    for cap in args.caps:
        drawn = lengths(args.num_requests, cap, args.mean, args.seed)
        steps = {"continuous": continuous_steps(drawn, args.slots),
                 "static": static_steps(drawn, args.slots)}  # fmt: skip
        got = {p: results[p][cap]["output_throughput"] for p in steps}
        assert all(results[p][cap]["output_tokens"] == sum(drawn) for p in steps)
        ideal = {p: sum(drawn) / (steps[p] * args.step_ms / 1000) for p in steps}
        ratio, limit = got["continuous"] / got["static"], steps["static"] / steps["continuous"]
        eff = {p: got[p] / ideal[p] for p in steps}
        step_ratio = results["static"][cap]["steps"] / results["continuous"][cap]["steps"]
        rows.append((cap, ratio, limit, eff, step_ratio))
        print(f"{cap:>5} {sum(drawn) / len(drawn):>6.1f} {got['continuous']:>11,.0f} "
              f"{got['static']:>12,.0f} {ratio:>6.2f} {limit:>6.2f} {ratio / limit:>8.0%} "
              f"{eff['continuous']:>8.3f} {eff['static']:>10.3f} "
              f"{_steps(results['continuous'][cap], steps['continuous']):>15} "
              f"{_steps(results['static'][cap], steps['static']):>15} "
              f"{results['continuous'][cap]['step_s'] * 1000:>6.1f}/"
              f"{results['static'][cap]['step_s'] * 1000:<5.1f} "
              f"{step_ratio:>10.2f} {step_ratio / limit:>8.0%}")  # fmt: skip
    if args.chart:
        chart(args.chart, rows)


def _steps(body: dict[str, Any], ideal: int) -> str:
    """Steps the server took / the schedule's ideal."""
    return f"{body['steps']:.0f}/{ideal}"


Row = tuple[int, float, float, dict[str, float], float]


def chart(path: str, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(cap) for cap, *_ in rows]
    xs = range(len(rows))
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar([x - 0.27 for x in xs], [r[1] for r in rows], 0.27, label="tokens/s ratio")
    left.bar(list(xs), [r[4] for r in rows], 0.27, label="step ratio (server's steps)")
    left.bar([x + 0.27 for x in xs], [r[2] for r in rows], 0.27, label="schedule's limit")
    left.set_title("continuous / static output tokens/s")
    right.bar([x - 0.2 for x in xs], [r[3]["continuous"] for r in rows], 0.4, label="continuous")
    right.bar([x + 0.2 for x in xs], [r[3]["static"] for r in rows], 0.4, label="static")
    right.axhline(0.95, color="grey", linestyle="--", label="goal 0.95")
    right.set_title("efficiency: achieved / ideal tokens/s")
    for axis in (left, right):
        axis.set_xticks(list(xs), labels)
        axis.set_xlabel("output length cap")
        axis.legend()
        axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
