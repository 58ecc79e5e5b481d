"""The issue-15 attacks, measured against a real server process (figures for docs/benchmarks.md):

1. header bomb: server RSS growth after one connection sends up to 20 MB of small headers
   without finishing the request, and how much it could send before the server cut it off;
2. non-reading streams: 8 clients that never read (1 ms steps, ``--send-timeout 2``, 8 slots),
   and one normal request queued behind them: when it completes, when every slot is free, and
   how many bytes were left queued for a non-reader;
3. slowloris: 300 connections that never finish their headers, the server's file limit
   lowered to 256: does /health still answer.
4. log probabilities (issue 27): the completions request ``n: 16, echo: true, logprobs: 20,
   prompt_logprobs: 20, max_tokens: 8`` on one 8k-token prompt, alone then 8 at once
   (default flags): status codes, time, and the server's RSS growth (now and at its peak).

Run: python benchmarks/edge_attacks.py [--root DIR]   (DIR: a checkout to measure, default
this one; e.g. --root ../main for the code before the fixes). Only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server(root: Path, *flags: str, files: int | None = None) -> Iterator[tuple[int, int]]:
    """(pid, port) of ``python -m app serve`` run from ``root``."""
    port = free_port()

    def limit() -> None:
        if files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    command = [sys.executable, "-m", "app", "serve", "--port", str(port), "--log-level",
               "warning", *flags]  # fmt: skip
    process = subprocess.Popen(command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                               stderr=subprocess.DEVNULL, preexec_fn=limit)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not healthy(port):
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.1)  # another process is binding: nothing to await
        yield process.pid, port
    finally:
        process.kill()
        process.wait()


def healthy(port: int, timeout: float = 1.0) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=timeout).status_code == 200
    return False


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """The process's resident memory (``VmHWM``: its peak so far) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def header_bomb(root: Path) -> None:
    with server(root) as (pid, port):
        before = rss_mib(pid)
        line = b"X-Header-Line: " + b"b" * 40 + b"\r\n"
        block, sent = line * (64 * 1024 // len(line)), 0
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\n")
            with contextlib.suppress(OSError):
                while sent < 20 << 20:
                    sock.sendall(block)
                    sent += len(block)
            peak = rss_mib(pid)
        time.sleep(1.0)  # let the server notice the close
        print(f"1. header bomb: sent {sent / (1 << 20):.2f} MiB before the server cut it off "
              f"(20 = never); RSS {before:.0f} -> {peak:.0f} MiB, {rss_mib(pid):.0f} MiB after "
              "close")  # fmt: skip


def non_readers(root: Path) -> None:
    flags = ("--send-timeout", "2", "--mock-step-ms", "1", "--num-slots", "8",
             "--max-model-len", "10000000")  # fmt: skip
    with server(root, *flags) as (_pid, port):
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"prompt": "x", "max_tokens": 9_000_000, "ignore_eos": True}).encode()
        readers, start = [], time.monotonic()
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                         b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            readers.append(sock)
        normal = {"prompt": "y", "max_tokens": 20, "stream": False}
        status = httpx.post(url + "/generate", json=normal, timeout=120).status_code
        queued = time.monotonic() - start
        while any(s["is_processing"] for s in httpx.get(url + "/slots").json()["slots"]):
            time.sleep(0.1)
        freed = time.monotonic() - start
        unread = 0
        readers[0].settimeout(5)
        with contextlib.suppress(OSError):
            while chunk := readers[0].recv(1 << 20):
                unread += len(chunk)
        for sock in readers:
            sock.close()
        print(f"2. non-readers: queued request {status} after {queued:.1f} s; every slot free "
              f"after {freed:.1f} s; {unread / 1024:.0f} KiB left for a non-reader")  # fmt: skip


def slowloris(root: Path) -> None:
    with server(root, files=256) as (pid, port):  # the default 10 s header timeout is ample
        attackers = []
        for _ in range(300):
            with contextlib.suppress(OSError):
                sock = socket.create_connection(("127.0.0.1", port), timeout=2)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
                attackers.append(sock)
        answers = sum(healthy(port, timeout=2) for _ in range(5))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        for sock in attackers:
            sock.close()
        print(f"3. slowloris, 300 connections, file limit 256: /health answered {answers} of 5; "
              f"server fds {fds}")  # fmt: skip


# --- 4. the log-probability attack (issue 27) ---
LOGPROB_ATTACK = {"prompt": [ord("a") + i % 26 for i in range(8184)], "n": 16, "echo": True,
                  "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 8}  # fmt: skip


def logprob_attack(root: Path, timeout: float = 300.0, rss_limit: float = 4096) -> None:
    """Each round on a fresh server; a server past ``rss_limit`` MiB is killed (the machine is
    shared) and reported so."""
    for count in (1, 8):
        with server(root) as (pid, port):
            url = f"http://127.0.0.1:{port}/v1/completions"
            before, start, peak, after = rss_mib(pid), time.monotonic(), 0.0, 0.0
            with ThreadPoolExecutor(count) as pool:
                answers = [pool.submit(_status, url, timeout) for _ in range(count)]
                while not all(a.done() for a in answers):
                    peak = max(peak, rss_mib(pid))
                    if peak > rss_limit:
                        os.kill(pid, signal.SIGKILL)
                        break
                    time.sleep(0.05)  # sampling another process's memory: nothing to await
                statuses = sorted({a.result() for a in answers})
            took = time.monotonic() - start
            if peak <= rss_limit:  # alive: its exact peak and its memory now
                peak, after = max(peak, rss_mib(pid, "VmHWM")), rss_mib(pid)
            killed = f", killed past {rss_limit:.0f} MiB" if peak > rss_limit else ""
            print(f"4. logprob attack x{count}: {', '.join(statuses)} after {took:.1f} s; RSS "
                  f"{before:.0f} MiB before, peak {peak:.0f} (+{peak - before:.0f}), "
                  f"{after:.0f} after{killed}", flush=True)  # fmt: skip


def _status(url: str, timeout: float) -> str:
    try:
        r = httpx.post(url, json=LOGPROB_ATTACK, timeout=timeout)
    except httpx.TimeoutException:
        return f"no answer within {timeout:.0f} s"
    except httpx.TransportError:
        return "connection lost"
    return f"{r.status_code} ({len(r.content) / (1 << 20):.1f} MiB)"


# --- end of 4 ---


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to measure")
    parser.add_argument("--only", type=int, choices=(1, 2, 3, 4), help="run one attack")
    args = parser.parse_args()
    print(f"measuring {args.root.resolve()}")
    attacks = (header_bomb, non_readers, slowloris, logprob_attack)
    for number, attack in enumerate(attacks, 1):
        if args.only in (None, number):
            attack(args.root)


if __name__ == "__main__":
    main()
