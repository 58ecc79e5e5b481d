"""Soak benchmark (issue 15): N minutes of mixed traffic against one real server process, with its
resident memory, open file descriptors, threads and asyncio tasks sampled every 10 s.

Traffic, at about 0.8 of capacity (closed loop: ``round(0.8 * slots)`` clients back to back):
- 65% of requests read their stream to the end and must get their final ``done`` event;
- 30% leave mid-stream (close the connection after a few events);
- 5% never read (send the request, hold the connection for 2x ``--send-timeout``, close);
- every 5 s, a request is cancelled with ``DELETE`` and its id submitted again at once;
- every 60 s, an overload burst of 3x (slots + max waiting) non-streamed requests (some 429).

At the end the traffic stops and the server must go idle: 0 running, 0 waiting (no leaked slot).
Printed and written to ``--json``: every sample, the slope of each series per hour (least squares
over the samples after ``--warmup`` seconds, leaving out those taken during a burst, which
the chart shows in red), and the request outcomes. ``--chart`` writes a PNG.

Run: PYTHONPATH=. python benchmarks/soak.py [--minutes 10] [--slots 8] [--step-ms 20]
     [--chart docs/soak.png] [--json soak.json]
Only 127.0.0.1 is used; the server started here is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_SECONDS = 10.0
SERIES = ("rss_mib", "fds", "threads", "tasks")


@dataclass
class Outcomes:
    """What the clients saw. ``full_admitted - full_final`` must be 0."""

    counts: Counter[str] = field(default_factory=Counter)

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n


def serve(port: int, args: argparse.Namespace) -> None:
    """The server side (run in a child process): the real app and server, plus one extra route
    reporting the event loop's task count, which cannot be read from outside."""
    from app.api.app import create_app
    from app.config import Settings
    from app.server import run

    settings = Settings(port=port, num_slots=args.slots, mock_step_ms=args.step_ms,
                        max_waiting=args.max_waiting, send_timeout=args.send_timeout,
                        log_level="warning")  # fmt: skip
    app = create_app(settings)

    async def tasks() -> dict[str, int]:
        return {"tasks": len(asyncio.all_tasks())}

    app.add_api_route("/soak/tasks", tasks, methods=["GET"])
    run(app, settings.host, port, settings.log_level)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_sample(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    values = {line.split(":")[0]: line.split(":")[1].split() for line in status}
    return {
        "rss_mib": int(values["VmRSS"][0]) / 1024,
        "threads": int(values["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def request_bytes(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /generate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip


async def open_request(port: int, body: dict[str, Any]) -> tuple[Any, Any, int]:
    """Send one POST /generate on a fresh connection; return reader, writer and the status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    writer.write(request_bytes(body))
    status = int((await reader.readline()).split()[1])
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # the headers
    return reader, writer, status


async def read_until_final(reader: Any, max_events: int | None = None) -> str | None:
    """Read SSE lines until the final event (its finish_reason) or ``max_events`` token events."""
    events = 0
    while True:
        line = await reader.readline()
        if not line:
            return None
        if line.startswith(b"event: token"):
            events += 1
            if max_events is not None and events >= max_events:
                return "left"
        elif line.startswith(b"event: error"):
            return "error"
        elif line.startswith(b"data: ") and b'"finish_reason"' in line:
            return str(json.loads(line[6:])["finish_reason"])


def body(rng: random.Random, request_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt": "Soak " * rng.randint(1, 40),
        "max_tokens": rng.randint(8, 160),
    }
    if request_id is not None:
        out |= {"request_id": request_id, "max_tokens": 400, "ignore_eos": True}
    return out


async def client(port: int, rng: random.Random, out: Outcomes, stop: asyncio.Event,
                 send_timeout: float, background: set[asyncio.Task[None]]) -> None:  # fmt: skip
    while not stop.is_set():
        kind = rng.random()
        if kind < 0.05:  # never reads: runs beside the closed loop, which moves on
            task = asyncio.create_task(never_reading(port, rng, out, send_timeout))
            background.add(task)
            task.add_done_callback(background.discard)
            continue
        reader, writer, status = await open_request(port, body(rng))
        try:
            if status != 200:
                out.add(f"status_{status}")
                continue
            if kind < 0.35:
                await read_until_final(reader, max_events=rng.randint(1, 6))
                out.add("left_mid_stream")
            else:
                out.add("full_admitted")
                final = await read_until_final(reader)
                out.add("full_final" if final is not None else "full_missing_final")
        finally:
            writer.close()


async def never_reading(port: int, rng: random.Random, out: Outcomes, send_timeout: float) -> None:
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes(body(rng)))
    out.add("never_read")
    await asyncio.sleep(2 * send_timeout)
    writer.close()


async def canceller(port: int, out: Outcomes, stop: asyncio.Event) -> None:
    """Every 5 s: start a long request, DELETE it after its first event, re-submit its id."""
    n = 0
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        while not stop.is_set():
            n += 1
            rid = f"soak-del-{n}"
            reader, writer, _status = await open_request(port, body(random.Random(n), rid))
            try:
                await read_until_final(reader, max_events=1)
                deleted = await http.delete(f"/requests/{rid}")
                out.add(f"delete_{deleted.status_code}")
                out.add(f"deleted_final_{await read_until_final(reader)}")
            finally:
                writer.close()
            again = await http.post("/generate", json={"prompt": "x", "max_tokens": 1,
                                                       "request_id": rid, "stream": False})  # fmt: skip
            out.add(f"resubmit_{again.status_code}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 5)


async def bursts(port: int, size: int, out: Outcomes, stop: asyncio.Event,
                 active: asyncio.Event) -> None:  # fmt: skip
    """Every 60 s, ``size`` non-streamed requests at once: past the queue bound they get 429.
    ``active`` is set while a burst runs (samples taken then are left out of the slopes)."""
    limits = httpx.Limits(max_connections=size)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                 limits=limits) as http:  # fmt: skip
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 60)
                return
            payload = {"prompt": "Burst ", "max_tokens": 16, "stream": False}
            active.set()
            replies = await asyncio.gather(
                *(http.post("/generate", json=payload) for _ in range(size)),
                return_exceptions=True,
            )
            active.clear()
            for reply in replies:
                code = reply.status_code if isinstance(reply, httpx.Response) else "exception"
                out.add(f"burst_{code}")


async def sampler(pid: int, port: int, samples: list[dict[str, float]], t0: float,
                  stop: asyncio.Event, burst: asyncio.Event) -> None:  # fmt: skip
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        while True:
            tasks = (await http.get("/soak/tasks")).json()["tasks"]
            samples.append({"t": time.monotonic() - t0, **proc_sample(pid), "tasks": tasks,
                            "burst": float(burst.is_set())})  # fmt: skip
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_SECONDS)
                return


def slope_per_hour(samples: list[dict[str, float]], key: str, warmup: float) -> float:
    points = [(s["t"], s[key]) for s in samples if s["t"] >= warmup and not s["burst"]]
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 3600 if var else 0.0


async def drive(pid: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    out, stop, burst = Outcomes(), asyncio.Event(), asyncio.Event()
    samples: list[dict[str, float]] = []
    background: set[asyncio.Task[None]] = set()
    rng = random.Random(args.seed)
    clients = max(1, round(0.8 * args.slots))
    t0 = time.monotonic()
    tasks = [
        asyncio.create_task(
            client(port, random.Random(rng.random()), out, stop, args.send_timeout, background)
        )
        for _ in range(clients)
    ]
    tasks += [
        asyncio.create_task(canceller(port, out, stop)),
        asyncio.create_task(bursts(port, 3 * (args.slots + args.max_waiting), out, stop, burst)),
    ]
    watcher = asyncio.create_task(sampler(pid, port, samples, t0, stop, burst))
    await asyncio.sleep(args.minutes * 60)
    stop.set()
    await asyncio.gather(*tasks, *background)
    await watcher
    idle = await wait_idle(port)
    return {"samples": samples, "outcomes": dict(out.counts), "idle": idle,
            "seconds": time.monotonic() - t0}  # fmt: skip


async def wait_idle(port: int, timeout: float = 30.0) -> dict[str, int]:
    """The slot table once the traffic has stopped (waits up to ``timeout`` for it to empty)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        deadline = time.monotonic() + timeout
        while True:
            table = (await http.get("/slots")).json()
            if (table["running"] == 0 and table["waiting"] == 0) or time.monotonic() > deadline:
                return {"running": table["running"], "waiting": table["waiting"]}
            await asyncio.sleep(0.5)


def chart(result: dict[str, Any], path: Path, warmup: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    labels = {"rss_mib": "RSS (MiB)", "fds": "open fds", "threads": "threads",
              "tasks": "asyncio tasks"}  # fmt: skip
    for ax, key in zip(axes.flat, SERIES, strict=True):
        ax.plot(minutes, [s[key] for s in samples], lw=1)
        during = [s for s in samples if s["burst"]]
        ax.plot([s["t"] / 60 for s in during], [s[key] for s in during], "r.", ms=4)
        ax.axvline(warmup / 60, color="grey", ls=":", lw=1)
        ax.set_title(f"{labels[key]}: slope {result['slopes_per_hour'][key]:+.2f}/h", fontsize=10)
        ax.set_ylim(bottom=0)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    fig.suptitle(
        f"slotserve soak: {result['seconds'] / 60:.0f} min, {result['config']}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--max-waiting", type=int, default=16)
    parser.add_argument("--send-timeout", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds left out of slopes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chart", type=Path, help="write a PNG chart here")
    parser.add_argument("--json", type=Path, help="write samples and results here")
    parser.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.serve_port:
        serve(args.serve_port, args)
        return
    port = free_port()
    command = [sys.executable, __file__, "--serve-port", str(port), "--slots", str(args.slots),
               "--step-ms", str(args.step_ms), "--max-waiting", str(args.max_waiting),
               "--send-timeout", str(args.send_timeout)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        wait_healthy(port)
        result = asyncio.run(drive(process.pid, port, args))
    finally:
        process.terminate()
        process.wait(timeout=30)
    result["config"] = (f"{args.slots} slots, step {args.step_ms:g} ms, max waiting "
                        f"{args.max_waiting}, send timeout {args.send_timeout:g} s")  # fmt: skip
    result["slopes_per_hour"] = {k: slope_per_hour(result["samples"], k, args.warmup)
                                 for k in SERIES}  # fmt: skip
    report(result, args.warmup)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.chart:
        chart(result, args.chart, args.warmup)


def wait_healthy(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)  # another process is binding: nothing to await
    raise RuntimeError("server did not start")


def report(result: dict[str, Any], warmup: float) -> None:
    samples = result["samples"]
    first = next((s for s in samples if s["t"] >= warmup and not s["burst"]), samples[0])
    last = samples[-1]
    print(f"soak: {result['seconds'] / 60:.1f} min, {result['config']}, {len(samples)} samples")
    print(f"{'series':>10}{'after warm-up':>15}{'end':>10}{'slope/h':>10}")
    for key in SERIES:
        print(f"{key:>10}{first[key]:>15.1f}{last[key]:>10.1f}"
              f"{result['slopes_per_hour'][key]:>+10.2f}")  # fmt: skip
    print("outcomes:", json.dumps(dict(sorted(result["outcomes"].items()))))
    print("idle at the end:", result["idle"])


if __name__ == "__main__":
    main()
