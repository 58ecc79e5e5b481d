"""The issue-15 attacks, measured against a real server process (figures for docs/benchmarks.md):

1. header bomb: server RSS growth after one connection sends up to 20 MB of small headers
   without finishing the request, and how much it could send before the server cut it off;
2. non-reading streams: 8 clients that never read (1 ms steps, ``--send-timeout 2``, 8 slots),
   and one normal request queued behind them: when it completes, when every slot is free, and
   how many bytes were left queued for a non-reader;
3. slowloris: 300 connections that never finish their headers, the server's file limit
   lowered to 256: does /health still answer.
4. log probabilities (issue 27, ``--only logprobs``): the completions request ``n: 16, echo: true, logprobs: 20,
   prompt_logprobs: 20, max_tokens: 8`` on one 8k-token prompt, alone then 8 at once
   (default flags): status codes, time, and the server's RSS growth (now and at its peak).

5. grammar attack (issue 27, ``--only grammar``): ``structured_outputs.grammar`` ``start: x "!"`` / ``x: x x | /[^!]/`` (its
   work per token grows with every token) at ``--mock-step-ms 5``: one request alone (the
   server's CPU seconds until it ends), then 4 streams x 2,000 tokens (how each ends, the
   server's CPU seconds for the 4, a plain 20-token /generate sent meanwhile), then 4 such
   streams whose clients disconnect after 300 tokens, when each token costs milliseconds (or
   after a 10 s stall), and the seconds until every slot is free. /health
   is sampled every ~50 ms throughout (p99 and max; a probe times out at 5 s). Each part gives
   up after 90 s (main's requests run for minutes).

6. KV-event replay (``--only kv-replay``): after enough traffic to fill the replay buffer, 20
   ZeroMQ clients ask for a replay from sequence 0 and never read: server RSS before, while
   they stay connected, and after they leave.

Run: python benchmarks/edge_attacks.py [--root DIR] [--only NAME ...]   (DIR: a checkout to
measure, default this one; e.g. --root ../main for the code before the fixes). Only 127.0.0.1
is used.
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
import threading
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


# --- issue 27: the grammar attack -----------------------------------------------------------

ATTACK_GRAMMAR = 'start: x "!"\nx: x x | /[^!]/'
ATTACK_TIMEOUT = 90.0  # seconds each part of the grammar attack may take
PROBE_TIMEOUT = 5.0  # seconds a /health probe waits
LEAVE_STALL = 10.0  # seconds without an event after which a leaving client leaves anyway


class HealthProbe(threading.Thread):
    """Samples /health every ~50 ms until stopped; ``latencies`` in seconds (a probe that timed
    out counts as ``PROBE_TIMEOUT``)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/health"
        self.latencies: list[float] = []
        self.timeouts = 0
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=PROBE_TIMEOUT) as client:
            while not self._halt.wait(0.05):
                start = time.monotonic()
                try:
                    client.get(self.url)
                except httpx.TransportError:
                    self.timeouts += 1
                self.latencies.append(time.monotonic() - start)

    def report(self) -> str:
        self._halt.set()
        self.join()
        ordered = sorted(self.latencies)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        return (f"/health p99 {p99 * 1e3:.0f} ms, max {ordered[-1] * 1e3:.0f} ms over "
                f"{len(ordered)} probes ({self.timeouts} timed out at {PROBE_TIMEOUT:.0f} s)")  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def attack_stream(port: int, tokens: int, results: list[str], leave_after: int = 0) -> None:
    """One streamed completion under the attack grammar; appends how it ended: its error type,
    ``finished``, ``left`` (the client disconnected after ``leave_after`` events, or after
    ``LEAVE_STALL`` seconds without one) or ``timeout``."""
    body = {"model": "slotserve-mock", "prompt": "hi", "max_tokens": tokens, "stream": True,
            "structured_outputs": {"grammar": ATTACK_GRAMMAR}}  # fmt: skip
    start, events, outcome = time.monotonic(), 0, "left" if leave_after else "timeout"
    timeout = LEAVE_STALL if leave_after else ATTACK_TIMEOUT
    with (
        contextlib.suppress(httpx.HTTPError),
        httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout
        ) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: {") and '"error"' in line:
                outcome = json.loads(line[6:])["error"].get("type") or "error"
                break
            if line == "data: [DONE]":
                outcome = "finished"
                break
            events += line.startswith("data: ")
            if leave_after and events >= leave_after:
                break
            if time.monotonic() - start > ATTACK_TIMEOUT:
                break
    results.append(f"{outcome} after {events} events, {time.monotonic() - start:.1f} s")


def run_streams(port: int, count: int, tokens: int, leave_after: int = 0) -> list[str]:
    results: list[str] = []
    threads = [threading.Thread(target=attack_stream, args=(port, tokens, results, leave_after))
               for _ in range(count)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def busy_slots(port: int) -> int | None:
    """Slots processing a request (None: /slots did not answer in time)."""
    with contextlib.suppress(httpx.HTTPError):
        slots = httpx.get(f"http://127.0.0.1:{port}/slots", timeout=PROBE_TIMEOUT).json()["slots"]
        return sum(bool(slot["is_processing"]) for slot in slots)
    return None


def grammar_attack(root: Path) -> None:
    flags = ("--mock-step-ms", "5")
    with server(root, *flags) as (pid, port):
        probe = HealthProbe(port)
        probe.start()
        before = cpu_seconds(pid)
        alone = run_streams(port, 1, 2000)
        print(f"5a. grammar attack, 1 stream x 2,000 tokens: {alone[0]}, server CPU "
              f"{cpu_seconds(pid) - before:.2f} s; {probe.report()}")  # fmt: skip
    with server(root, *flags) as (pid, port):
        probe = HealthProbe(port)
        probe.start()
        before, plain = cpu_seconds(pid), ""

        def send_plain() -> None:
            nonlocal plain
            time.sleep(1.0)  # into the attack
            start = time.monotonic()
            try:
                body = {"prompt": "y", "max_tokens": 20, "stream": False}
                status = httpx.post(f"http://127.0.0.1:{port}/generate", json=body,
                                    timeout=ATTACK_TIMEOUT).status_code  # fmt: skip
                plain = f"{status} after {time.monotonic() - start:.2f} s"
            except httpx.HTTPError as err:
                plain = f"{type(err).__name__} after {time.monotonic() - start:.1f} s"

        sender = threading.Thread(target=send_plain)
        sender.start()
        ends = run_streams(port, 4, 2000)
        sender.join()
        print(f"5b. grammar attack, 4 streams x 2,000 tokens: {'; '.join(sorted(ends))}; server "
              f"CPU {cpu_seconds(pid) - before:.2f} s for the 4; a plain /generate sent 1 s in: "
              f"{plain}; {probe.report()}")  # fmt: skip
    with server(root, *flags) as (_pid, port):
        probe = HealthProbe(port)
        probe.start()
        left = run_streams(port, 4, 2000, leave_after=300)
        gone, busy = time.monotonic(), busy_slots(port)
        while busy != 0 and time.monotonic() - gone < ATTACK_TIMEOUT:
            time.sleep(0.02)  # another process frees them: nothing to await
            busy = busy_slots(port)
        freed = f"{time.monotonic() - gone:.2f} s" if busy == 0 else f"> {ATTACK_TIMEOUT:.0f} s"
        print(f"5c. grammar attack, 4 streams that leave after 300 events ({'; '.join(left)}): "
              f"every slot free {freed} after the last client left; {probe.report()}")  # fmt: skip


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


# --- issue 27: the KV-event replay attack --------------------------------------------------


def replay_hoarders(root: Path, clients: int = 20, requests: int = 12_000) -> None:
    import random
    from concurrent.futures import ThreadPoolExecutor

    import zmq

    pub, rep = free_port(), free_port()
    flags = ("--enable-prefix-caching", "--kv-events-endpoint", f"tcp://*:{pub}",
             "--kv-events-replay-endpoint", f"tcp://*:{rep}", "--num-slots", "4",
             "--kv-cache-tokens", "8192")  # fmt: skip
    with server(root, *flags) as (pid, port):
        url, rng = f"http://127.0.0.1:{port}/generate", random.Random(0)
        prompts = ["".join(rng.choices("abcdefghij ", k=800)) for _ in range(requests)]
        with httpx.Client(timeout=30) as http, ThreadPoolExecutor(4) as pool:
            body = {"max_tokens": 1, "stream": False}
            list(pool.map(lambda p: http.post(url, json={**body, "prompt": p}), prompts))
        time.sleep(1.0)  # the publisher's thread sends the last batches
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        batches = next((line.split()[-1] for line in metrics.splitlines()
                        if line.startswith("slotserve:kv_events_batches_total")
                        and 'outcome="published"' in line), "?")  # fmt: skip
        before = rss_mib(pid)
        ctx = zmq.Context()
        socks = []
        for _ in range(clients):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)  # reads nothing: the server's side holds the rest
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(f"tcp://127.0.0.1:{rep}")
            sock.send_multipart((b"", (0).to_bytes(8, "big")))
            socks.append(sock)
        peak = before
        for _ in range(40):  # 10 s: the replays are answered a chunk per turn
            time.sleep(0.25)
            peak = max(peak, rss_mib(pid))
        during = rss_mib(pid)
        health = healthy(port, timeout=2)
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
        time.sleep(3.0)  # the server notices the closed connections
        after = rss_mib(pid)
        print(f"6. KV replay, {clients} clients asking from 0 and never reading after {requests} "
              f"requests ({batches} batches published): RSS {before:.0f} MiB before, peak {peak:.0f} (+{peak - before:.0f}), "
              f"{during:.0f} after 10 s, {after:.0f} MiB 3 s after they left; /health "
              f"{'answered' if health else 'did not answer'}")  # fmt: skip


ATTACKS = {
    "headers": header_bomb,
    "non-readers": non_readers,
    "slowloris": slowloris,
    "logprobs": logprob_attack,
    "grammar": grammar_attack,
    "kv-replay": replay_hoarders,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to measure")
    parser.add_argument("--only", action="append", choices=list(ATTACKS),
                        help="run only this attack (repeatable)")  # fmt: skip
    args = parser.parse_args()
    print(f"measuring {args.root.resolve()}")
    for name, attack in ATTACKS.items():
        if args.only is None or name in args.only:
            attack(args.root)


if __name__ == "__main__":
    main()
