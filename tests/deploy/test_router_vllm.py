"""The real vLLM router (``vllm-router``, a test extra) in front of real slotserve replicas.

Each policy is checked by where requests land (the replicas' ``vllm:request_success_total``),
streamed and not: ``round_robin`` spreads them evenly; ``power_of_two`` keeps new work off a
replica kept busy by requests the router never saw (so only our ``GET /get_load`` can tell it);
``cache_aware`` sends a repeated prefix to the replica that served it first; ``kv_aware`` reads
the replicas' KV events (and tokenizes through ``/v1/completions/render``) and sends a prompt to
the replica that holds its blocks, although the router never routed it before. No assertion
is on time: every wait is for an observable state (a load reported, a log line, a counter).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from replicas import Replica, client, start_replicas
from server_process import free_port, wait_until
from vllm_router import ROUTER_BIN, VllmRouter, running_router

pytestmark = pytest.mark.skipif(
    ROUTER_BIN is None, reason="vllm-router not installed (pip install -e '.[test]')"
)

MODEL = "slotserve-mock"
FLAGS = ("--mock-step-ms", "10", "--enable-prefix-caching")
PREFIX = "The quick brown fox jumps over the lazy dog; " * 9  # 405 tokens (the byte tokenizer)


def body_of(prompt: str, chat: bool, **fields: object) -> tuple[str, dict[str, object]]:
    """The route and body of a completion (``chat``: a one-message chat) of ``prompt``."""
    if chat:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **fields}
    return "/v1/completions", {"prompt": prompt, **fields}


def complete(
    url: str, prompt: str, stream: bool, chat: bool = False, headers: dict[str, str] | None = None
) -> httpx.Response:
    """A short completion through ``url``; a stream is read to its ``[DONE]``."""
    route, body = body_of(prompt, chat, model=MODEL, max_tokens=4, stream=stream)
    with client() as http:
        if not stream:
            return http.post(url + route, json=body, headers=headers)
        with http.stream("POST", url + route, json=body, headers=headers) as r:
            data = [line for line in r.iter_lines() if line.startswith("data:")]
            assert r.status_code == 200 and data[-1] == "data: [DONE]", data
            return r


def served(replicas: list[Replica]) -> list[float]:
    return [replica.successes() for replica in replicas]


def landed(before: list[float], replicas: list[Replica]) -> list[int]:
    """Requests each replica finished since ``before``."""
    return [int(now - then) for now, then in zip(served(replicas), before, strict=True)]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    workdir = tmp_path_factory.mktemp("router-replicas")
    with ExitStack() as stack:
        three = [Replica(workdir, f"r{i}", *FLAGS) for i in range(3)]
        start_replicas(stack, workdir, *three)
        yield three


def urls(replicas: list[Replica]) -> list[str]:
    return [replica.url for replica in replicas]


def test_round_robin_spreads_evenly(replicas: list[Replica], tmp_path: Path) -> None:
    with running_router(tmp_path, "round_robin", urls(replicas)) as router:
        before = served(replicas)
        for i in range(12):
            r = complete(router.url, f"hello {i}", stream=i % 2 == 1)
            assert r.status_code == 200
        assert landed(before, replicas) == [4, 4, 4]
        # vLLM's ORCA load report comes back through the router on a non-streamed answer
        asked = {"endpoint-load-metrics-format": "TEXT"}
        r = complete(router.url, "hi", stream=False, headers=asked)
        assert r.headers["endpoint-load-metrics"].startswith("TEXT named_metrics.")


SELECTION = re.compile(r"Power-of-two selection: (\S+)=(-?\d+) vs (\S+)=(-?\d+)")


def policy_saw(router: VllmRouter, url: str, load: int) -> bool:
    """Whether a power_of_two decision in the router's log weighed ``url`` at ``load`` or more."""
    for match in SELECTION.finditer(router.log()):
        for name, value in ((match[1], match[2]), (match[3], match[4])):
            if name == url and int(value) >= load:
                return True
    return False


def test_power_of_two_keeps_new_work_off_the_busy_replica(
    replicas: list[Replica], tmp_path: Path
) -> None:
    """The busy replica's requests came from elsewhere: the router's own in-flight count is 0
    for every replica, so without ``/get_load`` (main: 404) it would pick at random."""
    busy, held = replicas[0], 3
    ids = [f"hold-{uuid.uuid4().hex[:8]}" for _ in range(held)]
    body = {"prompt": "x", "max_tokens": 8000, "ignore_eos": True, "stream": False}
    with ThreadPoolExecutor(held) as pool, client(timeout=120) as http:
        holds = [
            pool.submit(http.post, busy.url + "/generate", json={**body, "request_id": rid})
            for rid in ids
        ]
        try:
            running = "vllm:num_requests_running"
            wait_until(lambda: busy.metric(running) >= held, 10, "the holds to run")
            with running_router(tmp_path, "power_of_two", urls(replicas)) as router:
                loads = wait_until(
                    lambda: next(
                        (w["load"] for w in http.get(router.url + "/get_loads").json()["workers"]
                         if w["worker"] == busy.url and w["load"] >= held), None,
                    ),
                    10, "the router to read the busy replica's /get_load",
                )  # fmt: skip
                assert loads >= held
                # the policy's copy is refreshed every second: route until a decision used it
                wait_until(
                    lambda: complete(router.url, "warm up", stream=False).status_code == 200
                    and policy_saw(router, busy.url, held),
                    15, "a power_of_two decision that saw the busy replica's load", interval=0.2,
                )  # fmt: skip
                before = served(replicas)
                for i in range(8):
                    assert complete(router.url, f"new {i}", stream=i % 2 == 1).status_code == 200
                spread = landed(before, replicas)
                assert spread[0] == 0 and sum(spread) == 8, spread
        finally:
            for rid in ids:
                http.delete(f"{busy.url}/requests/{rid}")
            for hold in holds:
                hold.result()


def test_cache_aware_sends_a_repeated_prefix_to_its_replica(
    replicas: list[Replica], tmp_path: Path
) -> None:
    with running_router(tmp_path, "cache_aware", urls(replicas)) as router:
        before = served(replicas)
        assert complete(router.url, PREFIX + "first", stream=False).status_code == 200
        holder = landed(before, replicas).index(1)
        hits = replicas[holder].metric("vllm:prefix_cache_hits_total")
        before = served(replicas)
        for i in range(6):
            complete(router.url, PREFIX + f"again {i}", stream=i % 2 == 1)
        spread = landed(before, replicas)
        assert spread[holder] == 6 and sum(spread) == 6, spread
        # and there the prefix was not computed again: its whole blocks came from the cache
        gained = replicas[holder].metric("vllm:prefix_cache_hits_total") - hits
        assert gained >= 6 * (len(PREFIX) // 16 * 16 - 16)


SEQUENCE = re.compile(r"live sequence advanced source=(\S+) rank=\d+ seq=(\d+)")


def events_seen(router: VllmRouter, url: str) -> int:
    """The last KV-event batch number the router's index took from ``url`` (-1: none)."""
    seqs = [int(m[2]) for m in SEQUENCE.finditer(router.log()) if m[1] == url]
    return max(seqs, default=-1)


def seed(replica: Replica, prompt: str, chat: bool = False) -> None:
    """Prefill ``prompt`` on ``replica`` directly (the router does not see the request) and wait
    until its KV events have been sent (to a subscriber already connected, see ``subscribed``;
    the router indexes them long before its next request has been rendered and scored)."""
    published = "slotserve:kv_events_batches_total"
    sent = replica.metric(published, outcome="published")
    with client() as http:
        route, body = body_of(prompt, chat, max_tokens=1)
        assert http.post(replica.url + route, json=body).status_code == 200
    wait_until(lambda: replica.metric(published, outcome="published") > sent, 10, "the events")


def subscribed(router: VllmRouter, replica: Replica) -> None:
    """Wait until the router's subscriber receives ``replica``'s events (a ZeroMQ subscriber
    misses what is published before its connection is up): prefill fresh prompts until one's
    events arrive."""
    with client() as http:

        def probe() -> bool:
            prompt = f"probe {uuid.uuid4().hex} " * 3
            http.post(replica.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            return wait_quietly(lambda: events_seen(router, replica.url) >= 0, 1.0)

        wait_until(probe, 20, f"the router to subscribe to {replica.name}'s events")


def wait_quietly(check: Callable[[], bool], timeout: float) -> bool:
    """Whether ``check`` came true within ``timeout`` seconds."""
    try:
        wait_until(check, timeout, "")
    except AssertionError:
        return False
    return True


def test_kv_aware_routes_to_the_replica_holding_the_blocks(tmp_path: Path) -> None:
    """Prompts prefilled on a replica behind the router's back: only the KV events tell the
    router where their blocks are. (With 2 replicas and 4 prompts, a router that ignored the
    events would pass by chance once in 16 runs.)"""
    ports = [free_port(), free_port()]
    with ExitStack() as stack:
        pair = [
            Replica(tmp_path, f"kv{i}", *FLAGS, "--kv-events-endpoint", f"tcp://*:{port}")
            for i, port in enumerate(ports)
        ]
        start_replicas(stack, tmp_path, *pair)
        sources = [
            flag
            for replica, port in zip(pair, ports, strict=True)
            for flag in ("--kv-event-source", f"{replica.url}=tcp://127.0.0.1:{port}")
        ]
        router = stack.enter_context(
            running_router(tmp_path, "kv_aware", urls(pair), *sources, "--kv-event-model", MODEL)
        )
        for replica in pair:
            subscribed(router, replica)
        # distinct from their first block on (a shared prefix would be cached on both replicas)
        prompts = {f"{name} {PREFIX}": pair[i % 2] for i, name in enumerate("wxyz")}
        for prompt, replica in prompts.items():
            seed(replica, prompt)
        for stream in (False, True):
            for prompt, replica in prompts.items():
                before = served(pair)
                assert complete(router.url, prompt, stream=stream).status_code == 200
                assert landed(before, pair)[pair.index(replica)] == 1, (prompt[0], stream)
        for i, replica in enumerate(pair):  # chats too (rendered by /v1/chat/completions/render)
            message = f"chat {i} {PREFIX}"
            seed(replica, message, chat=True)
            before = served(pair)
            assert complete(router.url, message, stream=i == 1, chat=True).status_code == 200
            assert landed(before, pair)[i] == 1, ("chat", i)
        # it tokenized through our render routes (main: 404, and it fell back to /tokenize)
        inputs = "vllm_router_kv_routing_inputs_total"
        assert router.metric(inputs, result="render") >= len(prompts) * 2 + len(pair)
        assert router.metric(inputs, result="tokenize") == 0
        # the router's own account: it credited the prompts' cached blocks (all but a few tokens)
        credited = re.findall(r"credited_prefix_tokens=(\d+)", router.log())
        assert credited and max(int(c) for c in credited) >= len(PREFIX) - 16
