"""How much of the step clock's ideal throughput the server delivers over HTTP.

A server with ``--num-slots 32 --mock-step-ms 5`` can at best produce 32 tokens every 5 ms
(6,400 tokens/s). 32 clients each stream ``--tokens`` tokens (eos ignored) at once, so every
slot is busy for ``tokens`` steps; the ideal wall time is ``tokens x 5 ms`` (plus one step for
the prompts). Efficiency = ideal time / measured time. Goal (issue 8): >= 0.90.

Run: .venv/bin/python benchmarks/step_clock_http.py [--tokens 600] [--repeats 3]
     [--checkout PATH ...]   (several checkouts are measured side by side, alternating)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

SLOTS, STEP_MS = 32, 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(checkout: Path, port: int) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "app", "serve", "--port", str(port), "--num-slots",
            str(SLOTS), "--mock-step-ms", str(STEP_MS), "--log-level", "warning"]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(checkout)}
    return subprocess.Popen(args, cwd=checkout, env=env)


async def wait_ready(url: str) -> None:
    async with httpx.AsyncClient() as client:
        for _ in range(200):
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("server did not start")


async def one_stream(client: httpx.AsyncClient, url: str, tokens: int) -> None:
    body = {"prompt": [104, 105], "max_tokens": tokens, "ignore_eos": True}
    async with client.stream("POST", f"{url}/generate", json=body) as response:
        async for _ in response.aiter_raw():
            pass


async def efficiency(url: str, tokens: int) -> float:
    limits = httpx.Limits(max_connections=SLOTS + 4)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one_stream(client, url, tokens) for _ in range(SLOTS)))
        elapsed = time.perf_counter() - started
    return (tokens + 1) * STEP_MS / 1000 / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkout", type=Path, action="append")
    args = parser.parse_args()
    checkouts = args.checkout or [Path(__file__).resolve().parents[1]]
    servers = {}
    for checkout in checkouts:
        port = free_port()
        servers[checkout] = (start_server(checkout, port), f"http://127.0.0.1:{port}")
    try:
        results: dict[Path, list[float]] = {c: [] for c in checkouts}
        for _, url in servers.values():
            asyncio.run(wait_ready(url))
        for _ in range(args.repeats):
            for checkout, (_, url) in servers.items():
                results[checkout].append(asyncio.run(efficiency(url, args.tokens)))
        print(f"{SLOTS} slots, {STEP_MS} ms steps, {SLOTS} streams x {args.tokens} tokens; "
              f"ideal {SLOTS / STEP_MS * 1000:,.0f} tokens/s")  # fmt: skip
        for checkout, values in results.items():
            runs = ", ".join(f"{v:.3f}" for v in values)
            print(f"  {checkout}: efficiency median {statistics.median(values):.3f} ({runs})")
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(10)


if __name__ == "__main__":
    main()
