"""Where an open SSE stream's memory goes. Prints, for 1,000 open streams at a 20 ms step:
Python heap per stream (tracemalloc, in the server process) and its split by the package that
allocated it, for

- ``baseline``: the bare stack, ../shared/bench/baseline_sse.py (FastAPI + sse-starlette + uvicorn);
- ``slotserve``: the server itself, with 1,000 slots so that every stream is running;
- ``lean``: the baseline with sse-starlette's response replaced by a hand-written one
  (``lean_sse_app.py``), to show what the per-response task group costs.

tracemalloc counts live Python objects only, so these figures sit below resident memory
(``sse_throughput.py`` measures that), but they say which code holds the memory.

Run: .venv/bin/python benchmarks/stream_memory.py [--streams 1000] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from collections import Counter as Tally
from pathlib import Path
from typing import Any

from sse_throughput import DEFAULT_BASELINE, ROOT, Counter, free_port, raise_fd_limit, stream

PACKAGES = ("sse_starlette", "anyio", "fastapi", "starlette", "uvicorn", "httptools", "asyncio")


def package_of(filename: str) -> str:
    """The package a source file belongs to: one of PACKAGES, ``app``, or ``other``."""
    parts = Path(filename).parts
    for name in PACKAGES:
        if name in parts:
            return name
    return "app" if "app" in parts and "site-packages" not in parts else "other"


def load_app(name: str, baseline_dir: Path) -> Any:
    if name == "baseline":
        os.environ["STEP_MS"] = "20"
        sys.path.insert(0, str(baseline_dir))
        from baseline_sse import app as baseline_app  # type: ignore[import-not-found]

        return baseline_app
    if name == "lean":
        from lean_sse_app import app as lean_app

        return lean_app
    from app.api.app import create_app
    from app.config import Settings

    settings = Settings(num_slots=1000, max_waiting=20000, mock_step_ms=20, max_model_len=1_000_000,
                        log_level="warning")  # fmt: skip
    return create_app(settings)


def serve(name: str, port: int, report: Path, baseline_dir: Path) -> None:
    """The server side: uvicorn in this process; SIGUSR1 takes a snapshot, and the second one
    writes the difference to ``report`` as JSON (bytes per package)."""
    import uvicorn

    tracemalloc.start()
    app = load_app(name, baseline_dir)
    snapshots: list[tracemalloc.Snapshot] = []

    def on_signal(_signum: int, _frame: object) -> None:
        snapshots.append(tracemalloc.take_snapshot())
        if len(snapshots) == 2:
            tally: Tally[str] = Tally()
            for stat in snapshots[1].compare_to(snapshots[0], "filename"):
                tally[package_of(stat.traceback[0].filename)] += stat.size_diff
            partial = report.with_suffix(".partial")
            partial.write_text(json.dumps(tally))
            partial.rename(report)  # the client never reads a half-written report

    signal.signal(signal.SIGUSR1, on_signal)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def open_streams(pid: int, port: int, streams: int) -> None:
    """Snapshot the idle server, open ``streams`` streams, snapshot again, close them."""
    os.kill(pid, signal.SIGUSR1)
    await asyncio.sleep(0.5)
    counter, stop = Counter(), asyncio.Event()
    tasks = [asyncio.create_task(stream(port, 900_000, counter, stop)) for _ in range(streams)]
    deadline = time.monotonic() + 120
    while counter.opened < streams and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    if counter.opened < streams:
        raise RuntimeError(f"only {counter.opened} of {streams} streams opened")
    await asyncio.sleep(1.5)
    os.kill(pid, signal.SIGUSR1)
    await asyncio.sleep(1.0)  # the snapshot is taken while the streams are still open
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def measure(name: str, streams: int, baseline_dir: Path) -> dict[str, int]:
    port = free_port()
    report = Path(f"/tmp/stream_memory.{os.getpid()}.{name}.json")
    report.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--serve", name, "--port", str(port),
               "--report", str(report), "--baseline", str(baseline_dir)]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT)
    try:
        _wait_until_listening(port)
        asyncio.run(open_streams(process.pid, port, streams))
        deadline = time.monotonic() + 60
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        tally: dict[str, int] = json.loads(report.read_text())
        return tally
    finally:
        process.terminate()
        process.wait(timeout=30)
        report.unlink(missing_ok=True)


def _wait_until_listening(port: int) -> None:
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"no server on port {port}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    parser.add_argument("--serve", choices=("baseline", "slotserve", "lean"))
    parser.add_argument("--port", type=int)
    parser.add_argument("--report", type=Path)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.report, args.baseline)
        return
    raise_fd_limit()
    columns = ("total", *PACKAGES, "app", "other")
    print(f"Python heap per open stream (KiB), {args.streams} streams, tracemalloc")
    print(f"{'server':>10}" + "".join(f"{c:>14}" for c in columns))
    for name in ("baseline", "slotserve", "lean"):
        tally = measure(name, args.streams, args.baseline)
        row = {"total": sum(tally.values()), **tally}
        print(f"{name:>10}" + "".join(f"{row.get(c, 0) / args.streams / 1024:>14.1f}"
                                      for c in columns))  # fmt: skip


if __name__ == "__main__":
    main()
