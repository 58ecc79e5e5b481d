"""SSE throughput and memory benchmark (issue: HTTP server). Prints, in one run:

1. tokens delivered per second, server CPU microseconds per token and the load generator's own
   CPU, with 100 and 1,000 concurrent streams at a 20 ms decode step, for slotserve and for the
   bare FastAPI + sse-starlette + uvicorn stack (../shared/bench/baseline_sse.py), driven by the
   same client in the same run;
2. slotserve's resident memory per open stream (1,000 streams) and per waiting request (10,000
   requests queued behind one slot), beyond an idle server; and the engine's own memory per
   waiting request (tracemalloc, in process).

Run: .venv/bin/python benchmarks/sse_throughput.py [--seconds 8] [--baseline DIR]
Only 127.0.0.1 is used; every server started here is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = ROOT.parent / "shared" / "bench"
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    port: int

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0


@contextlib.contextmanager
def started(
    name: str, command: list[str], port: int, cwd: Path, env: dict[str, str]
) -> Iterator[Server]:
    process = subprocess.Popen(command, cwd=cwd, env={**os.environ, **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    server = Server(name, process, port)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{name} did not start")
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def slotserve(port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "app", "serve", "--port", str(port), "--log-level", "warning",
            "--max-model-len", "1000000", *flags]  # fmt: skip


def baseline(port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "baseline_sse:app", "--port", str(port),
            "--log-level", "warning"]  # fmt: skip


class Counter:
    def __init__(self) -> None:
        self.tokens = 0
        self.events = 0
        self.opened = 0  # streams whose response has started
        self.counting = False


async def stream(port: int, max_tokens: int, counter: Counter, stop: asyncio.Event) -> None:
    """One SSE stream over a raw connection; counts token ids in every event while counting."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    body = json.dumps({"prompt": "Count ", "max_tokens": max_tokens, "ignore_eos": True}).encode()
    writer.write(b"POST /generate HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    try:
        status = await reader.readline()
        counter.opened += status.startswith(b"HTTP/1.1 200")
        while not stop.is_set():
            line = await reader.readline()
            if not line:
                return
            start = line.find(b'"tokens":')
            if start >= 0 and counter.counting:
                start = line.index(b"[", start)
                end = line.index(b"]", start)
                counter.tokens += line.count(b",", start, end) + 1
                counter.events += 1
    finally:
        writer.close()


async def measure_throughput(server: Server, streams: int, seconds: float) -> dict[str, float]:
    counter, stop = Counter(), asyncio.Event()
    tasks = [
        asyncio.create_task(stream(server.port, 900_000, counter, stop)) for _ in range(streams)
    ]
    await asyncio.sleep(2.0)  # every stream open and flowing
    cpu0, own0, t0 = server.cpu_seconds(), _own_cpu(), time.monotonic()
    counter.counting = True
    await asyncio.sleep(seconds)
    counter.counting = False
    elapsed = time.monotonic() - t0
    cpu, own = server.cpu_seconds() - cpu0, _own_cpu() - own0
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "tokens_per_s": counter.tokens / elapsed,
        "tokens_per_event": counter.tokens / max(counter.events, 1),
        "server_cpu_us_per_token": cpu / max(counter.tokens, 1) * 1e6,
        "server_cpu_share": cpu / elapsed,
        "client_cpu_share": own / elapsed,
    }


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def open_streams_rss(server: Server, streams: int, max_tokens: int) -> float:
    """KiB of resident memory per open request, beyond the idle server."""
    idle = server.rss_kib()
    counter, stop = Counter(), asyncio.Event()
    tasks = [
        asyncio.create_task(stream(server.port, max_tokens, counter, stop)) for _ in range(streams)
    ]
    deadline = time.monotonic() + 120
    while counter.opened < streams and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    await asyncio.sleep(1.0)
    loaded = server.rss_kib()
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return (loaded - idle) / streams


def engine_bytes_per_waiting_request(n: int = 10_000) -> float:
    """Bytes the engine holds per waiting request beyond its prompt (tracemalloc, in process)."""
    from app.config import Settings
    from app.serving import GenerationParams, Serving

    async def run() -> float:
        serving = Serving(Settings(num_slots=1, max_waiting=n + 10, mock_step_ms=1000))
        await serving.start()
        prompt = [65] * 16
        serving.submit(GenerationParams(prompt=list(prompt), max_tokens=10))  # holds the slot
        await asyncio.sleep(0.1)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        keep = [serving.submit(GenerationParams(prompt=list(prompt), max_tokens=10))
                for _ in range(n)]  # fmt: skip
        await asyncio.sleep(0.2)  # the engine has moved them from the inbox to the queue
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        prompt_bytes = sys.getsizeof(list(prompt))  # the request's own copy of its prompt
        del keep
        serving.engine.draining = True
        await serving.stop()
        return (after - before) / n - prompt_bytes

    return asyncio.run(run())


def raise_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="measurement window per case")
    parser.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 1000])
    args = parser.parse_args()
    raise_fd_limit()
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; step 20 ms; window {args.seconds} s"
    )
    print("\n1. SSE throughput, same client, same run")
    header = ("server", "streams", "tokens/s", "tok/event", "srv us/tok", "srv CPU", "client CPU")
    print("".join(f"{h:>12}" for h in header))
    results: dict[tuple[str, int], dict[str, float]] = {}
    for streams in args.streams:
        for name in ("baseline", "slotserve"):
            port = free_port()
            if name == "baseline":
                context = started(name, baseline(port), port, args.baseline, {"STEP_MS": "20"})
            else:
                flags = ("--num-slots", str(max(streams, 1)), "--max-waiting", "20000",
                         "--mock-step-ms", "20")  # fmt: skip
                context = started(name, slotserve(port, *flags), port, ROOT, {})
            with context as server:
                r = asyncio.run(measure_throughput(server, streams, args.seconds))
            results[(name, streams)] = r
            print(f"{name:>12}{streams:>12}{r['tokens_per_s']:>12,.0f}{r['tokens_per_event']:>12.2f}"
                  f"{r['server_cpu_us_per_token']:>12.1f}{r['server_cpu_share']:>12.0%}"
                  f"{r['client_cpu_share']:>12.0%}")  # fmt: skip
        ours, base = results[("slotserve", streams)], results[("baseline", streams)]
        print(f"{'ratio':>12}{streams:>12}{ours['tokens_per_s'] / base['tokens_per_s']:>11.2f}x"
              f"{'':>12}{ours['server_cpu_us_per_token'] / base['server_cpu_us_per_token']:>11.2f}x")  # fmt: skip

    print("\n2. memory: resident KiB per request beyond the idle server")
    for name in ("baseline", "slotserve"):
        port = free_port()
        if name == "baseline":
            context = started(name, baseline(port), port, args.baseline, {"STEP_MS": "20"})
        else:
            flags = ("--num-slots", "1000", "--mock-step-ms", "20", "--max-waiting", "20000")
            context = started(name, slotserve(port, *flags), port, ROOT, {})
        with context as server:
            per_stream = asyncio.run(open_streams_rss(server, 1000, 900_000))
        print(f"   {name:>10}: per open stream (1,000 streams)            {per_stream:6.1f} KiB")
    port = free_port()
    flags = ("--num-slots", "1", "--mock-step-ms", "100000", "--max-waiting", "20000")
    with started("slotserve", slotserve(port, *flags), port, ROOT, {}) as server:
        per_waiting = asyncio.run(open_streams_rss(server, 10_000, 10))
    print(f"   slotserve: per waiting request, over HTTP (10,000)       {per_waiting:6.1f} KiB")
    engine = engine_bytes_per_waiting_request()
    print(f"   slotserve: engine's own per waiting request (tracemalloc) {engine:6.0f} B + prompt")


if __name__ == "__main__":
    main()
