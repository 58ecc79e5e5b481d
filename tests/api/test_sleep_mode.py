"""Sleep mode (``--enable-sleep-mode``: vLLM's POST /sleep, POST /wake_up, GET /is_sleeping)
and readiness (``--startup-delay``): while asleep or starting, generation gets 503 and /health
says why; requests in flight when the server falls asleep end with ``abort``; the prefix cache
is emptied (a KV-event subscriber sees ``AllBlocksCleared``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import zmq
from conftest import ClientFactory, serving_of
from error_shape import field_of
from kv_subscriber import Recent, V026Batch
from server_process import free_port, running_server, wait_until

from app.engine.types import FinishReason
from app.serving import GenerationParams

COMPLETION = {"model": "slotserve-mock", "prompt": "Hello there, ", "max_tokens": 4}


async def test_sleep_refuses_generation_until_every_part_is_awake(
    make_client: ClientFactory,
) -> None:
    async with make_client(enable_sleep_mode=True, mock_step_ms=2.0) as client:
        serving = serving_of(client)
        stream = serving.submit(GenerationParams(prompt=[72, 105], max_tokens=8_000,
                                                 ignore_eos=True))  # fmt: skip
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        answer = await client.post("/sleep", params={"level": "2"})
        assert answer.status_code == 200 and answer.content == b""
        assert stream.seq.finish_reason is FinishReason.ABORT  # in flight: ended
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "sleeping"
        native = {"prompt": "Hi", "max_tokens": 2, "stream": False}
        for route, body in (("/v1/completions", COMPLETION), ("/generate", native)):
            refused = await client.post(route, json=body)
            assert refused.status_code == 503, refused.text
            assert refused.headers["x-slotserve-error-code"] == "sleeping"
            assert refused.headers["retry-after"] == "1"
        assert (await client.post("/wake_up", params={"tags": "weights"})).status_code == 200
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert (await client.post("/wake_up", params={"tags": "kv_cache"})).status_code == 200
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        # sleeping twice, waking with no tags
        assert (await client.post("/sleep")).status_code == 200
        assert (await client.post("/sleep")).status_code == 200
        assert (await client.post("/wake_up")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        metrics = (await client.get("/metrics")).text
        labels = 'engine="0",key="",model_name="slotserve-mock",reason="not_ready"'
        assert f"slotserve:requests_rejected_total{{{labels}}} 2.0" in metrics


async def test_bad_sleep_arguments_get_400_naming_the_parameter(
    make_client: ClientFactory,
) -> None:
    async with make_client(enable_sleep_mode=True) as client:
        for level in ("0", "3", "x"):
            answer = await client.post("/sleep", params={"level": level})
            assert answer.status_code == 400 and field_of(answer.json()["error"]) == "level"
        answer = await client.post("/wake_up", params={"tags": "gpu"})
        assert answer.status_code == 400 and field_of(answer.json()["error"]) == "tags"
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}


async def test_sleep_routes_need_the_flag(make_client: ClientFactory) -> None:
    async with make_client() as client:
        assert (await client.post("/sleep")).status_code == 404
        assert (await client.get("/is_sleeping")).status_code == 404


def test_startup_delay_holds_health_at_503_then_serves() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", str(port),
                                "--log-level", "warning", "--startup-delay", "2"])  # fmt: skip

    def answer() -> httpx.Response | None:
        try:
            return httpx.get(url + "/health", timeout=1.0)
        except httpx.TransportError:
            return None

    try:
        first = wait_until(answer, 20, "the server to answer")
        if time.monotonic() - started < 2:  # (a very slow start may pass the delay first)
            assert first.status_code == 503 and first.json()["status"] == "starting"
            refused = httpx.post(url + "/v1/completions", json=COMPLETION)
            assert (
                refused.status_code == 503
                and refused.headers["x-slotserve-error-code"] == "starting"
            )
        wait_until(lambda: (r := answer()) is not None and r.status_code == 200, 20, "ready")
        assert time.monotonic() - started >= 2
        assert httpx.post(url + "/v1/completions", json=COMPLETION).status_code == 200
    finally:
        process.kill()
        process.wait(10)


def test_a_real_server_clears_its_kv_events_books_on_sleep(tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    flags = ("--enable-sleep-mode", "--enable-prefix-caching", "--block-size", "4",
             "--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", replay)  # fmt: skip
    decoder = msgspec.msgpack.Decoder(V026Batch)  # (the default encoding)
    with running_server(*flags) as server:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        try:
            prompt = "A shared system prompt that spans blocks. "
            for tail in ("one", "two"):
                body = {**COMPLETION, "prompt": prompt + tail}
                assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
            assert httpx.post(server.url + "/sleep").status_code == 200
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            batches = []
            while True:
                assert dealer.poll(5000)
                _, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                batches.append(decoder.decode(payload))
            events = [e for b in batches for e in b.events]
            assert all(b.data_parallel_rank == 0 for b in batches)
            assert isinstance(events[0], Recent.BlockStored)
            assert isinstance(events[-1], Recent.AllBlocksCleared)
            metrics = httpx.get(server.url + "/metrics").text
            assert (
                'slotserve:kv_events_batches_total{engine="0",model_name="slotserve-mock",outcome="published"}'
                in metrics
            )
        finally:
            dealer.close(linger=0)
            ctx.term()
