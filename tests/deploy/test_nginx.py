"""nginx in front of real slotserve replicas, all on 127.0.0.1.

The configuration is ``docker/nginx.conf.template`` rendered by ``docker/render_nginx.py``, the
same template (and renderer) that produces the ``docker/nginx.conf`` docker-compose mounts; only
the listen address and the replica addresses differ. Each replica is a real
``python -m app serve`` process; nginx runs in the foreground with its prefix (pid file, temp
directories) in a temporary directory.

The tests are skipped only when no nginx binary is found (``.ci/run`` installs Debian's
``nginx-light``). Select them with ``pytest -k nginx``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from deploy_files import load_renderer
from replicas import Replica, client, start_replicas
from server_process import free_port, wait_until

NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")
NGINX = shutil.which("nginx") or next(
    (path for path in NGINX_CANDIDATES if os.access(path, os.X_OK)), None
)
pytestmark = pytest.mark.skipif(
    NGINX is None, reason="no nginx binary found (.ci/run installs Debian's nginx-light)"
)

T = TypeVar("T")
STEP_MS = 10  # mock decode step: 100 tokens/s per request, slow enough to watch a stream


def generate_body(max_tokens: int, stream: bool, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": "hello nginx",
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }
    if request_id is not None:
        body["request_id"] = request_id
    return body


def sse_events(response: httpx.Response) -> Generator[tuple[str, dict[str, Any]], None, None]:
    """(event, data) per SSE event; comments (pings) are skipped."""
    event, data = "message", ""
    for line in response.iter_lines():
        if not line:
            if data:
                yield event, json.loads(data)
            event, data = "message", ""
        elif line.startswith("event:"):
            event = line[len("event:") :].strip()
        elif line.startswith("data:"):
            data += line[len("data:") :].strip()


class Nginx:
    """nginx in the foreground, configured from the shipped template."""

    def __init__(self, workdir: Path, upstreams: list[str]) -> None:
        self.prefix = workdir / "nginx"
        self.prefix.mkdir(exist_ok=True)
        self.port = free_port()
        self.conf = self.prefix / "nginx.conf"
        self.conf.write_text(load_renderer().render(upstreams, f"127.0.0.1:{self.port}"))
        self.log_path = self.prefix / "nginx.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert NGINX is not None
        command = [NGINX, "-e", "stderr", "-p", f"{self.prefix}/", "-c", str(self.conf)]
        command += ["-g", "daemon off;"]
        with self.log_path.open("ab") as log:
            # Its own process group, so the master and its workers can be stopped together.
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

        def listening() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"nginx exited:\n{self.log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return True
            except OSError:
                return False

        wait_until(listening, 10, "nginx to listen")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # SIGTERM: fast shutdown of the master and its workers
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


class Cluster:
    def __init__(self, nginx: Nginx, replicas: tuple[Replica, ...]) -> None:
        self.nginx, self.replicas = nginx, replicas

    def holder_of(self, request_id: str) -> Replica:
        """The replica running ``request_id`` (polled: it may still be being admitted)."""

        def find() -> Replica | None:
            return next((r for r in self.replicas if request_id in r.running_ids()), None)

        return wait_until(find, 5, f"a replica to run {request_id}")


@contextmanager
def cluster(workdir: Path, *flags_per_replica: tuple[str, ...]) -> Iterator[Cluster]:
    workdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        replicas = tuple(
            Replica(workdir, f"replica{i}", *flags) for i, flags in enumerate(flags_per_replica)
        )
        start_replicas(stack, workdir, *replicas)
        nginx = Nginx(workdir, [f"127.0.0.1:{r.port}" for r in replicas])
        stack.callback(nginx.stop)
        nginx.start()
        yield Cluster(nginx, replicas)


SMALL = ("--num-slots", "1", "--mock-step-ms", str(STEP_MS), "--shutdown-grace", "1")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two one-slot replicas behind nginx, shared by the tests that leave them idle."""
    with cluster(tmp_path_factory.mktemp("nginx-pair"), SMALL, SMALL) as running:
        yield running


def test_nginx_spreads_requests_over_both_replicas(pair: Cluster) -> None:
    before = [r.successes() for r in pair.replicas]
    url = pair.nginx.url + "/generate"

    def one(_: int) -> int:
        with client() as http:
            answer = http.post(url, json=generate_body(4, stream=False))
            assert answer.status_code == 200, answer.text
            assert answer.json()["finish_reason"] == "length"
            return len(answer.json()["tokens"])

    with client() as http:  # one keep-alive client connection, one request after the other
        for _ in range(10):
            answer = http.post(url, json=generate_body(4, stream=False))
            assert answer.status_code == 200, answer.text
    with ThreadPoolExecutor(max_workers=5) as pool:  # and some at once
        assert list(pool.map(one, range(10))) == [4] * 10

    def served() -> list[float] | None:
        counts = [r.successes() - b for r, b in zip(pair.replicas, before, strict=True)]
        return counts if sum(counts) >= 20 else None

    counts = wait_until(served, 5, "the replicas to count 20 requests")
    assert sum(counts) == 20
    assert all(count >= 3 for count in counts), f"requests per replica: {counts}"


def test_nginx_streams_token_by_token(pair: Cluster) -> None:
    max_tokens = 50  # 50 steps of 10 ms: about half a second from first token to last
    arrivals: list[float] = []
    tokens: list[int] = []
    done: dict[str, Any] = {}
    with client() as http:
        start = time.monotonic()
        body = generate_body(max_tokens, stream=True)
        with http.stream("POST", pair.nginx.url + "/generate", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for event, data in sse_events(response):
                if event == "token":
                    arrivals.append(time.monotonic() - start)
                    tokens += data["tokens"]
                elif event == "done":
                    done = data
                    finished = time.monotonic() - start
    assert done["finish_reason"] == "length"
    assert len(tokens) == max_tokens == len(done["tokens"])
    first = arrivals[0]
    # Buffered by nginx, every event would arrive together at the end. (How soon the first
    # token arrives is a latency, measured in benchmarks, not asserted here.)
    spread = finished - first
    assert spread > 0.2, f"all tokens within {spread:.3f} s: buffered?"
    early = sum(1 for t in arrivals if t < first + spread / 2)
    assert early >= 5, f"only {early} of {len(arrivals)} token events in the first half"


def open_generate(port: int, body: dict[str, Any]) -> socket.socket:
    """Send ``POST /generate`` on a raw connection and leave the answer unread."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(head.encode() + payload)
    return sock


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "no-stream"])
def test_nginx_client_disconnect_frees_the_slot(pair: Cluster, streamed: bool) -> None:
    """A client that goes away through nginx frees its slot: with a stream (nginx's writes fail)
    and without one (nothing flows; nginx must notice the closed connection by itself)."""
    long_id, queued_id = f"nginx-long-{uuid.uuid4().hex}", f"nginx-queued-{uuid.uuid4().hex}"
    long_body = generate_body(5000, stream=streamed, request_id=long_id)  # ~50 s if not freed
    leaving = open_generate(pair.nginx.port, long_body)
    try:
        replica = pair.holder_of(long_id)  # its only slot is now taken
        # The module's replicas are shared by every test (and both parametrisations): count
        # this test's abort from here, not the cumulative total.
        aborts = replica.metric("vllm:request_success_total", finished_reason="abort")
        if streamed:
            received = b""
            while b"event: token" not in received:
                chunk = leaving.recv(4096)
                assert chunk, "nginx closed the stream"
                received += chunk
            assert received.startswith(b"HTTP/1.1 200")
        with client() as direct:
            queued_body = generate_body(3, stream=True, request_id=queued_id)
            with direct.stream("POST", replica.url + "/generate", json=queued_body) as queued:
                assert queued.status_code == 200
                wait_until(lambda: replica.slots()["waiting"] == 1, 5, "the request to queue")
                assert replica.running_ids() == {long_id}

                leaving.close()  # the client goes away

                # nginx closes its upstream connection; the replica aborts the long request
                # and admits the queued one into the freed slot.
                wait_until(
                    lambda: (
                        long_id not in replica.running_ids() and replica.slots()["waiting"] == 0
                    ),
                    5,
                    "the replica to free the slot",
                )
                queued_events = list(sse_events(queued))
    finally:
        leaving.close()
    assert queued_events[-1][0] == "done"
    assert queued_events[-1][1]["finish_reason"] == "length"
    assert len(queued_events[-1][1]["tokens"]) == 3
    assert replica.metric("vllm:request_success_total", finished_reason="abort") == aborts + 1


def test_nginx_cancel_reaches_the_replica_holding_the_request(pair: Cluster) -> None:
    request_id = f"nginx-cancel-{uuid.uuid4().hex}"
    with client() as http:
        body = generate_body(5000, stream=True, request_id=request_id)
        with http.stream("POST", pair.nginx.url + "/generate", json=body) as stream:
            events = sse_events(stream)
            assert next(events)[0] == "token"
            pair.holder_of(request_id)
            # least_conn sends the DELETE to the other (idle) replica first; its 404 makes
            # nginx try the next replica, which holds the request.
            with client() as other:
                answer = other.delete(f"{pair.nginx.url}/requests/{request_id}")
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"request_id": request_id, "cancelled": True}
            last = [data for event, data in events if event == "done"]
    assert last[0]["finish_reason"] == "abort"
    with client() as http:
        assert http.delete(f"{pair.nginx.url}/requests/nginx-unknown").status_code == 404


@contextmanager
def occupy(http: httpx.Client, replica: Replica, queued: int = 0) -> Iterator[None]:
    """Hold ``replica``'s only slot with a long stream sent to it directly, and put ``queued``
    more long streams in its waiting queue."""
    with ExitStack() as stack:
        for i in range(1 + queued):
            body = generate_body(5000, stream=True)
            stream = stack.enter_context(http.stream("POST", replica.url + "/generate", json=body))
            assert stream.status_code == 200
            if i == 0:
                events = sse_events(stream)  # keep it: a dropped generator closes the response
                assert next(events)[0] == "token"
        wait_until(lambda: replica.slots()["waiting"] == queued, 5, "the queue to fill")
        yield


def test_nginx_retries_429_on_the_other_replica(tmp_path: Path) -> None:
    full = ("--num-slots", "1", "--max-waiting", "1", "--mock-step-ms", str(STEP_MS))
    with cluster(tmp_path, full, SMALL) as running, client() as http:
        busy, free = running.replicas
        with occupy(http, busy, queued=1):  # one running, one waiting: the queue is full
            refused = http.post(busy.url + "/generate", json=generate_body(2, stream=False))
            assert refused.status_code == 429  # the busy replica refuses on its own...
            rejected = busy.metric("slotserve:requests_rejected_total", reason="queue_full")
            before = free.successes()
            with client() as lb:
                for _ in range(10):  # ...but through nginx every request is served
                    answer = lb.post(running.nginx.url + "/generate", json=generate_body(2, False))
                    assert answer.status_code == 200, answer.text
                body = generate_body(3, stream=True)
                with lb.stream("POST", running.nginx.url + "/generate", json=body) as stream:
                    assert stream.status_code == 200
                    assert [e for e, _ in sse_events(stream)][-1] == "done"
            retried = busy.metric("slotserve:requests_rejected_total", reason="queue_full")
            assert retried > rejected, "nginx never tried the busy replica"
            assert free.successes() - before == 11


def test_nginx_retries_503_while_a_replica_drains(tmp_path: Path) -> None:
    draining = ("--num-slots", "1", "--mock-step-ms", str(STEP_MS), "--shutdown-grace", "30")
    with cluster(tmp_path, draining, SMALL) as running, client() as http:
        leaving, staying = running.replicas
        with occupy(http, leaving):
            leaving.signal(signal.SIGTERM)  # drains: the running stream may finish, new: 503

            def refusing() -> bool:
                return http.get(leaving.url + "/health").status_code == 503

            wait_until(refusing, 5, "the replica to drain")
            before = staying.successes()
            with client() as lb:
                for _ in range(10):
                    answer = lb.post(running.nginx.url + "/generate", json=generate_body(2, False))
                    assert answer.status_code == 200, answer.text
                assert lb.get(running.nginx.url + "/health").status_code == 200
            assert staying.successes() - before == 10
            assert leaving.metric("slotserve:requests_rejected_total", reason="draining") >= 1
            leaving.signal(signal.SIGTERM)  # a second signal: exit now


def test_nginx_survives_a_killed_replica(tmp_path: Path) -> None:
    with cluster(tmp_path, SMALL, SMALL) as running:
        killed, survivor = running.replicas
        assert killed.proc is not None
        killed.proc.kill()
        killed.proc.wait(timeout=5)
        before = survivor.successes()
        with client() as lb:
            for i in range(10):
                if i % 2:
                    answer = lb.post(running.nginx.url + "/generate", json=generate_body(2, False))
                    assert answer.status_code == 200, answer.text
                else:
                    body = generate_body(2, stream=True)
                    with lb.stream("POST", running.nginx.url + "/generate", json=body) as stream:
                        assert stream.status_code == 200
                        assert [e for e, _ in sse_events(stream)][-1] == "done"
        assert survivor.successes() - before == 10


def test_nginx_answers_overload_of_every_replica_in_our_error_shape(tmp_path: Path) -> None:
    """Found in review: 429s count as replica failures in nginx, so a burst against full
    replicas marked both down and nginx answered its own HTML 502, and a cancel could no
    longer reach the replica holding the request. Now every answer is a JSON 429 or 503 with
    Retry-After, and the cancel still gets through."""
    full = ("--num-slots", "1", "--max-waiting", "0", "--mock-step-ms", str(STEP_MS))
    with cluster(tmp_path, full, full) as running, client() as http, ExitStack() as held:
        for i, replica in enumerate(running.replicas):
            body = generate_body(5000, stream=True, request_id=f"nginx-victim-{i}")
            stream = held.enter_context(http.stream("POST", replica.url + "/generate", json=body))
            events = sse_events(stream)
            assert next(events)[0] == "token"
            held.callback(events.close)
        with client() as lb:
            for _ in range(8):
                answer = lb.post(running.nginx.url + "/generate", json=generate_body(2, False))
                assert answer.status_code in (429, 503), answer.text
                assert answer.headers["content-type"].startswith("application/json")
                assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
                assert answer.json()["error"]["code"] == answer.status_code  # vLLM's shape
                assert answer.headers["x-slotserve-error-code"] in (
                    "queue_full",
                    "no_replica_available",
                )
                assert int(answer.headers["retry-after"]) >= 1
            cancel = lb.delete(f"{running.nginx.url}/requests/nginx-victim-1")
            assert cancel.status_code == 200, cancel.text
