"""The real vLLM router's prefill/decode mode (``--vllm-pd-disaggregation``) in front of one
slotserve producer and one consumer: the router sends the prompt to the producer with
``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``, copies the answer's
``kv_transfer_params`` into the decode request, and the consumer pulls the blocks from the
producer (``POST /v1/kv_transfer/fetch``) instead of prefilling. Checked, streamed and not, on
completions and chat: the same text as one combined server (greedy mock), no warning in the
router's log, the consumer computes one prompt token (the last, to sample from), the
producer's held blocks are released by the pull, and a client that leaves mid-stream frees
both sides."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import pytest
from replicas import Replica, client, start_replicas
from server_process import wait_until
from vllm_router import ROUTER_BIN, VllmRouter, running_router

pytestmark = pytest.mark.skipif(
    ROUTER_BIN is None, reason="vllm-router not installed (pip install -e '.[test]')"
)

MODEL = "slotserve-mock"
FLAGS = ("--mock-step-ms", "2", "--mock-stop-probability", "0", "--block-size", "16")
CONFIG = '{{"kv_connector":"NixlConnector","kv_role":"{role}"}}'
PROMPT = "The quick brown fox jumps over the lazy dog; " * 4  # 180 tokens (the byte tokenizer)
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


class Setup:
    def __init__(self, combined: Replica, producer: Replica, consumer: Replica) -> None:
        self.combined, self.producer, self.consumer = combined, producer, consumer


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    workdir = tmp_path_factory.mktemp("router-pd")
    with ExitStack() as stack:
        combined = Replica(workdir, "combined", *FLAGS)
        producer = Replica(
            workdir, "producer", *FLAGS, "--kv-transfer-config", CONFIG.format(role="kv_producer")
        )
        consumer = Replica(
            workdir, "consumer", *FLAGS, "--kv-transfer-config", CONFIG.format(role="kv_consumer")
        )
        start_replicas(stack, workdir, combined, producer, consumer)
        yield Setup(combined, producer, consumer)


def pd_router(tmp_path: Path, setup: Setup) -> AbstractContextManager[VllmRouter]:
    """The router in P/D mode: the producer prefills, the consumer decodes (NIXL's params)."""
    return running_router(
        tmp_path, "round_robin", [], "--vllm-pd-disaggregation",
        "--prefill", setup.producer.url, "--decode", setup.consumer.url, "--kv-connector", "nixl",
    )  # fmt: skip


def ask(url: str, chat: bool, stream: bool, max_tokens: int = 12) -> str:
    """The reply's text through ``url`` (a stream read to its ``[DONE]``)."""
    fields: dict[str, object] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
    fields["stream"] = stream
    body: dict[str, object] = {"prompt": PROMPT}
    route = "/v1/completions"
    if chat:
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}
    with client(timeout=30) as http:
        if not stream:
            answer = http.post(url + route, json=body | fields)
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            return str(choice["message"]["content"] if chat else choice["text"])
        with http.stream("POST", url + route, json=body | fields) as r:
            data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        assert r.status_code == 200 and data[-1] == "[DONE]", data
        chunks = [json.loads(d)["choices"] for d in data[:-1]]
        key = "delta" if chat else None
        return "".join(
            (c[0][key].get("content") or "") if key else c[0]["text"] for c in chunks if c
        )


@pytest.mark.parametrize(("chat", "stream"), [(False, False), (False, True), (True, False),
                                              (True, True)])  # fmt: skip
def test_pd_mode_answers_as_one_server_and_the_decoder_computes_no_prompt(
    setup: Setup, tmp_path: Path, chat: bool, stream: bool
) -> None:
    expected = ask(setup.combined.url, chat, stream=False)
    consumer, producer = setup.consumer, setup.producer
    pulled = consumer.metric(BY_SOURCE, source="external_kv_transfer")
    computed = consumer.metric(BY_SOURCE, source="local_compute")
    with pd_router(tmp_path, setup) as router:
        assert ask(router.url, chat, stream) == expected
        log = router.log()
    assert "No kv_transfer_params" not in log, log[-2000:]
    assert consumer.metric(BY_SOURCE, source="external_kv_transfer") - pulled > 100
    assert consumer.metric(BY_SOURCE, source="local_compute") - computed == 1
    assert producer.metric("vllm:kv_cache_usage_perc") == 0  # the pull released the hold
    assert consumer.metric("slotserve:kv_transfer_fallbacks_total") == 0


def test_a_client_leaving_mid_stream_frees_both_sides(setup: Setup, tmp_path: Path) -> None:
    consumer, producer = setup.consumer, setup.producer
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
            "stream": True, "temperature": 0}  # fmt: skip
    with pd_router(tmp_path, setup) as router:
        with (
            client(timeout=30) as http,
            http.stream("POST", router.url + "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                seen += line.startswith("data:")
                if seen >= 5:
                    break
            assert consumer.metric("vllm:num_requests_running") == 1
        running = "vllm:num_requests_running"
        wait_until(lambda: consumer.metric(running) == 0, 10, "the decode to be aborted")
        wait_until(
            lambda: consumer.metric("vllm:kv_cache_usage_perc") == 0, 10, "the decoder's blocks"
        )
        assert producer.metric("vllm:kv_cache_usage_perc") == 0
        assert producer.metric(running) == 0
