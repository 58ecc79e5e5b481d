"""What the KV-event sockets expose (issue 27, finding 5), against a real server: the documented
``tcp://*:P`` listens where HTTP listens (loopback by default) and a socket bound beyond
loopback is warned of at start (events carry prompt token ids); replay clients that ask from
sequence 0 and never read cost a bounded amount of memory, however many come, and a reading
client is served again once they leave."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import zmq
from server_process import ServerProcess, free_port, running_server

from app.kv_events.publisher import beyond_loopback, binds, bound_endpoint


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


LOOPBACK_HEX = "0100007F"  # 127.0.0.1


def _start(pub: str, rep: str, log: Path) -> tuple[set[str], set[str], str]:
    """Start a server with these endpoints: where the PUB and replay ports listen (while it
    runs) and its log."""
    ports = [int(endpoint.rsplit(":", 1)[1]) for endpoint in (pub, rep)]
    with log.open("wb") as sink, running_server(
        "--enable-prefix-caching", "--kv-events-endpoint", pub,
        "--kv-events-replay-endpoint", rep, stderr=sink,
    ):  # fmt: skip
        where = _listening(ports[0]), _listening(ports[1])
    return *where, log.read_text()


def test_a_star_endpoint_listens_where_http_listens(tmp_path: Path) -> None:
    pub, rep, log = _start(f"tcp://*:{free_port()}", f"tcp://*:{free_port()}", tmp_path / "log")
    assert pub == {LOOPBACK_HEX} == rep
    assert "beyond loopback" not in log


def test_a_socket_bound_beyond_loopback_is_warned_of(tmp_path: Path) -> None:
    port = free_port()
    pub, rep, log = _start(f"tcp://0.0.0.0:{port}", f"tcp://*:{free_port()}", tmp_path / "log")
    assert pub == {"00000000"} and rep == {LOOPBACK_HEX}
    warnings = [line for line in log.splitlines() if "beyond loopback" in line]
    assert len(warnings) == 1 and f"tcp://0.0.0.0:{port}" in warnings[0]
    assert "token ids" in warnings[0]


@pytest.mark.parametrize(
    ("endpoint", "host", "bound", "binding", "exposed"),
    [
        ("tcp://*:5557", "127.0.0.1", "tcp://127.0.0.1:5557", True, False),
        ("tcp://*:5557", "0.0.0.0", "tcp://*:5557", True, True),
        ("tcp://*:5557", "::1", "tcp://[::1]:5557", True, False),
        ("tcp://*:5557", "10.1.2.3", "tcp://10.1.2.3:5557", True, True),
        ("tcp://0.0.0.0:5557", "127.0.0.1", "tcp://0.0.0.0:5557", True, True),
        ("tcp://epp:5557", "127.0.0.1", "tcp://epp:5557", False, False),  # connected to
        ("ipc:///tmp/kv", "0.0.0.0", "ipc:///tmp/kv", True, False),
    ],
)  # fmt: skip
def test_where_an_endpoint_binds(
    endpoint: str, host: str, bound: str, binding: bool, exposed: bool
) -> None:
    assert bound_endpoint(endpoint, host) == bound
    assert binds(endpoint) is binding
    assert (binding and beyond_loopback(bound)) is exposed


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@contextmanager
def _replaying_server() -> Iterator[tuple[ServerProcess, str]]:
    rep = free_port()
    with running_server(
        "--enable-prefix-caching", "--kv-events-endpoint", f"tcp://*:{free_port()}",
        "--kv-events-replay-endpoint", f"tcp://*:{rep}", "--num-slots", "4",
        "--kv-cache-tokens", "16384",
    ) as server:  # fmt: skip
        yield server, f"tcp://127.0.0.1:{rep}"


def _traffic(server: ServerProcess, requests: int) -> None:
    """Prompts of 4,000 tokens: each prefill publishes ~12 KB of BlockStored token ids."""
    rng = random.Random(0)
    prompts = ["".join(rng.choices("abcdefghij ", k=4000)) for _ in range(requests)]
    with httpx.Client(timeout=30) as http, ThreadPoolExecutor(4) as pool:
        body = {"max_tokens": 1, "stream": False}
        answers = pool.map(lambda p: http.post(server.url + "/generate", json={**body,
                                                                              "prompt": p}),
                           prompts)  # fmt: skip
        assert {a.status_code for a in answers} == {200}


def _replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, tries: int = 5) -> list[int]:
    """A reading client: the sequence numbers of a whole replay from 0 (asking again after a
    silence of 3 s, as a client should)."""
    for _ in range(tries):
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs: list[int] = []
        try:
            while dealer.poll(3000):
                _, seq, _payload = dealer.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return seqs
                seqs.append(int.from_bytes(seq, "big"))
        finally:
            dealer.close(linger=0)
    raise AssertionError(f"no whole replay in {tries} tries")


def test_replay_clients_that_never_read_cost_bounded_memory() -> None:
    """20 clients ask for the whole history (~800 batches) and never read: vLLM's settings
    (and main's) queue all of it per client (+30 MiB measured), here at most 8 clients x 100
    batches (+3 MiB)."""
    with _replaying_server() as (server, endpoint):
        _traffic(server, 400)
        ctx = zmq.Context()
        whole = _replay(ctx, endpoint)
        assert whole == list(range(len(whole))) and len(whole) > 400
        pid = server.process.pid
        before = _rss_mib(pid)
        hoarders = []
        for _ in range(20):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(endpoint)
            sock.send_multipart((b"", (0).to_bytes(8, "big")))
            hoarders.append(sock)
        peak = before
        deadline = time.monotonic() + 4  # past the 2 s after which non-readers are dropped
        while time.monotonic() < deadline:
            peak = max(peak, _rss_mib(pid))
            time.sleep(0.1)  # sampling another process's memory: nothing to await
        assert peak - before < 12, f"RSS {before:.0f} -> {peak:.0f} MiB"
        for sock in hoarders:
            sock.close(linger=0)
        assert _replay(ctx, endpoint) == whole  # served again (the socket may be reset first)
        ctx.term()
