"""Long requests among short ones, under each scheduling policy (issue 10).

The server: 8 slots, a step of 6 ms plus 0.005 ms per prefill token (so recomputing a preempted
request is not free), the KV-cache mock. The workload (native API, streamed, eos ignored):

- ``long-among-short``: 4 requests of 2,000 output tokens sent first (priority 10), then a
  Poisson stream of 20-token requests (priority 0) at 0.7 of the server's capacity for them
  (8 slots / (20 steps x 6 ms) = 66.7 requests/s) for ``--seconds``. Run under fcfs, priority
  and mlfq, and the short stream alone (fcfs) as the reference.
- ``two-users``: user ``heavy`` sends 4x the load of user ``light``, 1.2x the capacity in all,
  under fcfs and fair, and ``light`` alone as the reference.

Per run: short requests' TTFT (first ``token`` event, parsed from the raw SSE bytes) and E2E
p50/p99, the long requests' completion times (from the start of the run), output tokens/s over
the arrival window (``vllm:generation_tokens_total``, scraped at its start and end),
preemptions (``vllm:num_preemptions_total``). A chart per run in docs/.

Run: /work/venv/bin/python benchmarks/policies.py [--seconds 25] [--only mlfq,...]
     [--step-ms 6] [--long-tokens 2000] [--simulate] [--preemption-delay S] [--overhead]
The machine is shared and noisy: compare runs made together, not absolute numbers.
``--simulate`` runs the same workloads through the ``Scheduler`` alone, in virtual time (each
step lasts exactly what the step clock says; no HTTP, no noise), which isolates the policies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SLOTS, SHORT_TOKENS, NUM_LONG = 8, 20, 4


@dataclass(frozen=True)
class Scale:
    """The step clock and the long requests' length. The issue's numbers are 6 ms, 0.005 ms
    per prefill token and 2,000 tokens; ``--step-ms`` scales the prefill cost with the step."""

    step_ms: float = 6.0
    long_tokens: int = 2000

    @property
    def prefill_ms(self) -> float:
        return 0.005 * self.step_ms / 6.0

    @property
    def capacity(self) -> float:
        """Short requests/s the slots can serve."""
        return SLOTS / (SHORT_TOKENS * self.step_ms / 1000)


PROMPT = "Tell me a short story about a fox. "  # 35 tokens (byte-level tokenizer)


@dataclass
class Result:
    kind: str  # "short", "long" or a user name
    sent: float
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    status: int = 0


@dataclass
class Run:
    name: str
    policy: str
    results: list[Result] = field(default_factory=list)
    tokens_per_s: float = 0.0
    preemptions: float = 0.0
    seconds: float = 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(port: int, policy: str, scale: Scale, extra: list[str]) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "app", "serve", "--port", str(port), "--num-slots", str(SLOTS),
            "--mock-step-ms", str(scale.step_ms), "--mock-prefill-ms", str(scale.prefill_ms),
            "--policy", policy, "--max-waiting", "4096", "--log-level", "warning", *extra]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen(args, cwd=ROOT, env=env)


async def wait_healthy(client: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)  # another process is binding: nothing to await
    raise TimeoutError("server did not start")


async def metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def one(
    client: httpx.AsyncClient, t0: float, result: Result, body: dict[str, object]
) -> None:
    """Stream one request; TTFT at the first token event, E2E at the done event."""
    async with client.stream("POST", "/generate", json=body) as response:
        result.status = response.status_code
        buffer = b""
        async for chunk in response.aiter_raw():
            buffer += chunk
            now = time.monotonic()
            if result.ttft is None and b"event: token" in buffer:
                result.ttft = now - t0 - result.sent
            if b"event: done" in buffer:
                result.e2e = now - t0 - result.sent
        done = buffer[buffer.rfind(b"event: done") :].split(b"data: ", 1)
        if len(done) == 2:
            result.tokens = len(json.loads(done[1].split(b"\n", 1)[0])["tokens"])


def body(max_tokens: int, priority: int, user: str | None) -> dict[str, object]:
    out: dict[str, object] = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                              "priority": priority}  # fmt: skip
    if user is not None:
        out["user"] = user
    return out


async def drive(
    run: Run, port: int, streams: list[tuple[str, float]], longs: int, long_tokens: int
) -> None:
    """``streams``: (kind, requests/s) Poisson streams of short requests; ``longs``: long
    requests sent first."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(600.0)
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        await wait_healthy(client)
        rng = random.Random(7)
        arrivals: list[tuple[float, str]] = []
        for kind, rate in streams:
            t = rng.expovariate(rate)
            while t < run.seconds:
                arrivals.append((t, kind))
                t += rng.expovariate(rate)
        arrivals.sort()
        tasks = []
        tokens0 = await metric(client, "vllm:generation_tokens_total")
        t0 = time.monotonic()
        for _ in range(longs):
            result = Result("long", 0.0)
            run.results.append(result)
            tasks.append(asyncio.create_task(one(client, t0, result, body(long_tokens, 10, None))))
        for at, kind in arrivals:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process itself: a schedule, not a sync
            result = Result(kind, at)
            run.results.append(result)
            user = None if kind == "short" else kind
            tasks.append(asyncio.create_task(one(client, t0, result, body(SHORT_TOKENS, 0, user))))
        await asyncio.sleep(max(0.0, t0 + run.seconds - time.monotonic()))
        window = time.monotonic() - t0
        run.tokens_per_s = (await metric(client, "vllm:generation_tokens_total") - tokens0) / window
        await asyncio.gather(*tasks)
        run.preemptions = await metric(client, "vllm:num_preemptions_total")


def simulate(
    run: Run,
    streams: list[tuple[str, float]],
    longs: int,
    scale: Scale,
    preemption_delay: float = 0.0,
) -> None:
    """The workload through the scheduler alone, in virtual time (see the module docstring):
    ``app.simulate.run.simulate`` with the linear step clock, no API time, admission at the
    next step boundary."""
    from app.engine.policies import PolicyConfig, PolicyName
    from app.engine.scheduler import SchedulerConfig
    from app.engine.step_clock import StepClock, StepCosts, StepWork
    from app.simulate.run import Overheads
    from app.simulate.run import simulate as replay
    from app.simulate.workload import SimRequest, Stage, Workload

    policy = PolicyConfig(PolicyName(run.policy), preemption_delay=preemption_delay)
    config = SchedulerConfig(SLOTS, max_num_batched_tokens=2048, policy=policy)
    rng, prompt = random.Random(7), [1] * len(PROMPT)
    arrivals: list[tuple[float, str]] = []
    for kind, rate in streams:
        t = rng.expovariate(rate)
        while t < run.seconds:
            arrivals.append((t, kind))
            t += rng.expovariate(rate)
    arrivals.sort()
    kinds = ["long"] * longs + [kind for _, kind in arrivals]
    requests = [SimRequest(0.0, prompt, scale.long_tokens, 10) for _ in range(longs)]
    requests += [SimRequest(at, prompt, SHORT_TOKENS, 0, None if kind == "short" else kind)
                 for at, kind in arrivals]  # fmt: skip
    window_tokens = 0

    def count(start: float, end: float, work: StepWork) -> None:
        nonlocal window_tokens
        if end <= run.seconds:
            window_tokens += work.sampled

    clock = StepClock(StepCosts(scale.step_ms, scale.prefill_ms))
    workload = Workload([Stage(requests)], 0.0)
    (stage,) = replay(workload, config, clock, Overheads(late_admission=False), math.inf, count)
    for kind, record in zip(kinds, stage.records, strict=True):
        assert record.first_token is not None and record.last_token is not None
        result = Result(kind, record.sent, record.first_token - record.sent,
                        record.last_token - record.sent, record.output_len, 200)  # fmt: skip
        run.results.append(result)
    run.preemptions = stage.preemptions
    run.tokens_per_s = window_tokens / run.seconds


def overhead_us(policy: str, slots: int, waiting: int, steps: int = 200) -> float:
    """Scheduler cost per step (schedule + update, microseconds) with every slot busy decoding
    and ``waiting`` requests queued (mixed priorities and users): each step the policy chooses
    the waiting request it would preempt for (a scan of the queue); the preemption delay is set
    so that none happens, to measure the choice alone."""
    from app.engine.policies import PolicyConfig, PolicyName
    from app.engine.scheduler import Scheduler, SchedulerConfig
    from app.engine.step import ModelOutput
    from app.engine.types import Sequence

    never = PolicyConfig(PolicyName(policy), preemption_delay=1e9)  # choose, never preempt
    config = SchedulerConfig(slots, max_num_batched_tokens=max(2048, slots), policy=never)
    sched = Scheduler(config)
    for i in range(slots + waiting):
        running = i < slots
        seq = Sequence(f"r{i}", [1] * 16, 10**6, frozenset(), priority=-5 if running else i % 7,
                       user=f"u{i % 4}")  # fmt: skip
        sched.add(seq, 0.0)
        if running:  # admitted before the others arrive
            out = sched.schedule(0.0)
            sched.update(out, ModelOutput([5] * out.num_outputs), 0.0)
    for _ in range(3):  # every admitted request decoding
        out = sched.schedule(0.0)
        sched.update(out, ModelOutput([5] * out.num_outputs), 0.0)
    start = time.perf_counter()
    for _ in range(steps):
        out = sched.schedule(0.0)
        sched.update(out, ModelOutput([5] * out.num_outputs), 0.0)
    return (time.perf_counter() - start) / steps * 1e6


def report_overhead() -> None:
    print("scheduler cost per step (us, median of 5), every slot decoding, requests waiting")
    print(f"{'slots':>6} {'waiting':>8}" + "".join(f"{p:>10}" for p in POLICY_NAMES))
    for slots, waiting in ((8, 0), (8, 64), (8, 1024), (256, 0), (256, 64), (256, 1024)):
        row = [statistics.median(overhead_us(p, slots, waiting) for _ in range(5))
               for p in POLICY_NAMES]  # fmt: skip
        print(f"{slots:>6} {waiting:>8}" + "".join(f"{v:>10.1f}" for v in row), flush=True)


POLICY_NAMES = ("fcfs", "priority", "mlfq", "fair")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(run: Run) -> dict[str, object]:
    out: dict[str, object] = {"run": run.name, "policy": run.policy}
    for kind in sorted({r.kind for r in run.results} - {"long"}):
        shorts = [r for r in run.results if r.kind == kind]
        ttft = [r.ttft for r in shorts if r.ttft is not None]
        e2e = [r.e2e for r in shorts if r.e2e is not None]
        out[kind] = {
            "n": len(shorts), "failed": sum(r.status != 200 for r in shorts),
            "ttft_p50_ms": round(pct(ttft, 0.5) * 1000, 1),
            "ttft_p99_ms": round(pct(ttft, 0.99) * 1000, 1),
            "e2e_p50_ms": round(pct(e2e, 0.5) * 1000, 1),
            "e2e_p99_ms": round(pct(e2e, 0.99) * 1000, 1),
        }  # fmt: skip
    longs = [r.e2e for r in run.results if r.kind == "long" and r.e2e is not None]
    if longs:
        out["long_done_s"] = [round(t, 2) for t in sorted(longs)]
    out["output_tokens_per_s"] = round(run.tokens_per_s)
    out["preemptions"] = int(run.preemptions)
    return out


def chart(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for kind in sorted({r.kind for r in run.results} - {"long"}):
        shown = [r for r in run.results if r.kind == kind and r.ttft is not None]
        sent, ttft = [r.sent for r in shown], [(r.ttft or 0.0) * 1000 for r in shown]
        ax.scatter(sent, ttft, s=4, label=f"{kind} requests' TTFT")
    for i, r in enumerate(sorted(x.e2e for x in run.results if x.kind == "long" and x.e2e)):
        ax.axvline(r, color="red", lw=0.8, ls="--", label="a long request ends" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title(f"{run.name}: --policy {run.policy}")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


SHORT, HEAVY, LIGHT = [("short", 0.7)], [("heavy", 0.96)], [("light", 0.24)]
RUNS: dict[str, tuple[str, list[tuple[str, float]], int]] = {  # policy, (kind, x capacity), longs
    "short-only": ("fcfs", SHORT, 0),
    "fcfs": ("fcfs", SHORT, NUM_LONG),
    "priority": ("priority", SHORT, NUM_LONG),
    "mlfq": ("mlfq", SHORT, NUM_LONG),
    "light-alone": ("fcfs", LIGHT, 0),
    "two-users-fcfs": ("fcfs", HEAVY + LIGHT, 0),
    "two-users-fair": ("fair", HEAVY + LIGHT, 0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--only", default=",".join(RUNS), help="comma list of runs")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--server-flag", action="append", default=[], help="extra server flag")
    parser.add_argument("--step-ms", type=float, default=6.0)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--simulate", action="store_true", help="the scheduler alone, virtual time")
    parser.add_argument("--preemption-delay", type=float, default=0.0, help="policy flag")
    parser.add_argument("--overhead", action="store_true", help="scheduler cost per step only")
    args = parser.parse_args()
    if args.overhead:
        report_overhead()
        return
    scale = Scale(args.step_ms, args.long_tokens)
    suffix = f"_delay{args.preemption_delay:g}" if args.preemption_delay else ""
    for name in args.only.split(","):
        policy, loads, longs = RUNS[name]
        streams = [(kind, share * scale.capacity) for kind, share in loads]
        run = Run(name, policy, seconds=args.seconds)
        if args.simulate:
            simulate(run, streams, longs, scale, args.preemption_delay)
            print(json.dumps(summary(run) | {"simulated": True}), flush=True)
            chart(run, args.out / f"policy_sim_{name}{suffix}.png")
            continue
        port = free_port()
        extra = [*args.server_flag, "--preemption-delay", str(args.preemption_delay)]
        server = start_server(port, policy, scale, extra)
        try:
            asyncio.run(drive(run, port, streams, longs, scale.long_tokens))
        finally:
            server.terminate()
            server.wait(30)
        print(json.dumps(summary(run)), flush=True)
        chart(run, args.out / f"policy_{name}{suffix}.png")


if __name__ == "__main__":
    main()
