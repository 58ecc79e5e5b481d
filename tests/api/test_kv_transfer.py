"""Prefill/decode disaggregation in process: a producer app and a consumer app, the consumer's
pull sent to the producer's app over an ASGI transport (the real HTTP path is in
tests/deploy/test_router_vllm.py, behind the vLLM router)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from conftest import app_client, serving_of
from sse import parse_sse

from app.serving import Serving

NIXL = '{{"kv_connector":"NixlConnector","kv_role":"{role}","engine_id":"{id}"}}'
COMMON: dict[str, Any] = {"mock_stop_probability": 0.0, "block_size": 4}
PROMPT = "the quick brown fox jumps over the lazy dog and runs far away into the woods"
# what the vLLM router adds to the client's body for the prefill leg
PREFILL_ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def body(**extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 8, "temperature": 0} | extra


@asynccontextmanager
async def pair(
    consumer: dict[str, Any] | None = None, **producer: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """A producer and a consumer; the consumer's pulls reach the producer's app."""
    p_config = NIXL.format(role="kv_producer", id="prod")
    c_config = NIXL.format(role="kv_consumer", id="cons")
    async with (
        app_client(kv_transfer_config=p_config, port=8101, **COMMON | producer) as prod,
        app_client(kv_transfer_config=c_config, port=8102, **COMMON | (consumer or {})) as cons,
    ):
        transfer = serving_of(cons).kv_transfer
        assert transfer is not None
        producer_app = prod.asgi_app  # type: ignore[attr-defined]
        transfer._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=producer_app))
        yield prod, cons


def usage(serving: Serving) -> float:
    return serving.engine.core.kv_cache_usage()


def metric(serving: Serving, name: str, **labels: str) -> float:
    for family in serving.metrics.families.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels}")


async def prefill(prod: httpx.AsyncClient, route: str = "/v1/completions") -> dict[str, Any]:
    extra = {"max_tokens": 1, "kv_transfer_params": PREFILL_ASK}
    payload = body(**extra) if route == "/v1/completions" else chat(**extra)
    answer = await prod.post(route, json=payload)
    assert answer.status_code == 200, answer.text
    params: dict[str, Any] = answer.json()["kv_transfer_params"]
    return params


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0} | extra  # fmt: skip


async def test_a_split_request_answers_what_one_server_does_and_computes_no_prompt() -> None:
    async with app_client(**COMMON) as alone:
        expected = (await alone.post("/v1/completions", json=body())).json()
    async with pair() as (prod, cons):
        params = await prefill(prod)
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prod"
        assert params["remote_port"] == 8101 and params["remote_host"] == "127.0.0.1"
        assert params["remote_block_ids"] and usage(serving_of(prod)) > 0  # held
        answer = await cons.post("/v1/completions", json=body(kv_transfer_params=params))
        assert answer.status_code == 200, answer.text
        prompt_len = expected["usage"]["prompt_tokens"]
        assert answer.headers["x-kv-transfer"] == f"pulled; tokens={prompt_len - 1}"
        assert answer.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        assert usage(serving_of(prod)) == 0  # fetched: released
        by_source = "vllm:prompt_tokens_by_source_total"
        consumer = serving_of(cons)
        assert metric(consumer, by_source, source="external_kv_transfer") == prompt_len - 1
        assert metric(consumer, by_source, source="local_compute") == 1


async def test_a_streamed_chat_decode_pulls_too_and_matches() -> None:
    async with app_client(**COMMON) as alone:
        expected = (await alone.post("/v1/chat/completions", json=chat())).json()
    async with pair() as (prod, cons):
        params = await prefill(prod, "/v1/chat/completions")
        answer = await cons.post(
            "/v1/chat/completions", json=chat(kv_transfer_params=params, stream=True)
        )
        assert answer.headers["x-kv-transfer"].startswith("pulled; tokens=")
        chunks = [e.data for e in parse_sse(answer.text) if isinstance(e.data, dict)]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        text = "".join(delta.get("content") or "" for delta in deltas)
        assert text == expected["choices"][0]["message"]["content"]
        assert usage(serving_of(prod)) == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("yes", "kv_transfer_params"),
        ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
        ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1},
         "kv_transfer_params.remote_engine_id"),
        ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1",
          "remote_port": 0}, "kv_transfer_params.remote_port"),
        ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1",
          "remote_port": 80, "remote_block_ids": ["a"]}, "kv_transfer_params.remote_block_ids"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "kv_transfer_params"),
    ],
)  # fmt: skip
async def test_wrong_shapes_are_a_400_naming_the_field(params: Any, field: str) -> None:
    async with app_client(kv_transfer_config=NIXL.format(role="kv_both", id="b"), **COMMON) as c:
        for route, payload in (("/v1/completions", body()), ("/v1/chat/completions", chat())):
            answer = await c.post(route, json=payload | {"kv_transfer_params": params})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == field


async def test_a_server_refuses_what_its_role_cannot_serve() -> None:
    pull = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1",
            "remote_port": 80, "remote_block_ids": [1]}  # fmt: skip
    async with pair() as (prod, cons):
        refused = await prod.post("/v1/completions", json=body(kv_transfer_params=pull))
        assert refused.status_code == 400
        assert "kv_producer" in refused.json()["error"]["message"]
        refused = await cons.post("/v1/completions", json=body(kv_transfer_params=PREFILL_ASK))
        assert refused.status_code == 400
        assert "kv_consumer" in refused.json()["error"]["message"]
    async with app_client(**COMMON) as plain:
        for ask in (pull, PREFILL_ASK):
            refused = await plain.post("/v1/completions", json=body(kv_transfer_params=ask))
            assert refused.status_code == 400
            assert "--kv-transfer-config" in refused.json()["error"]["message"]
        # vLLM's neutral parameters (nothing asked) are accepted anywhere
        fine = await plain.post("/v1/completions", json=body(kv_transfer_params={}))
        assert fine.status_code == 200 and "kv_transfer_params" not in fine.json()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"remote_engine_id": "someone-else"}, "unknown_engine"),
        ({"remote_request_id": "never-held"}, "expired"),
        ({"remote_host": "8.8.8.8"}, "untrusted_peer"),
    ],
)
async def test_a_failed_pull_prefills_locally_and_says_so(
    change: dict[str, str], reason: str
) -> None:
    async with app_client(**COMMON) as alone:
        expected = (await alone.post("/v1/completions", json=body())).json()
    async with pair() as (prod, cons):
        params = await prefill(prod) | change
        answer = await cons.post("/v1/completions", json=body(kv_transfer_params=params))
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kv-transfer"] == f"fallback; reason={reason}"
        assert answer.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        consumer = serving_of(cons)
        assert metric(consumer, "slotserve:kv_transfer_fallbacks_total", reason=reason) == 1
        by_source = "vllm:prompt_tokens_by_source_total"
        assert metric(consumer, by_source, source="external_kv_transfer") == 0


async def test_held_blocks_expire_on_time_and_a_late_pull_falls_back() -> None:
    async with pair(kv_transfer_hold_s=0.05) as (prod, cons):
        params = await prefill(prod)
        assert usage(serving_of(prod)) > 0
        for _ in range(100):  # the idle engine lets them go on time
            if usage(serving_of(prod)) == 0:
                break
            await asyncio.sleep(0.01)
        assert usage(serving_of(prod)) == 0
        answer = await cons.post("/v1/completions", json=body(kv_transfer_params=params))
        assert answer.headers["x-kv-transfer"] == "fallback; reason=expired"


async def test_the_fetch_route_answers_404_with_a_code() -> None:
    async with pair() as (prod, _):
        params = await prefill(prod)
        ask = {"engine_id": "prod", "request_id": params["remote_request_id"]}
        first = await prod.post("/v1/kv_transfer/fetch", json=ask)
        assert first.status_code == 200 and first.json()["num_tokens"] > 0
        again = await prod.post("/v1/kv_transfer/fetch", json=ask)
        assert again.status_code == 404 and again.headers["x-slotserve-error-code"] == "expired"
        other = await prod.post("/v1/kv_transfer/fetch", json=ask | {"engine_id": "x"})
        assert other.status_code == 404
        assert other.headers["x-slotserve-error-code"] == "unknown_engine"
        bad = await prod.post("/v1/kv_transfer/fetch", json={"engine_id": 3})
        assert bad.status_code == 400


async def test_a_streamed_prefill_holds_nothing() -> None:
    async with pair() as (prod, _):
        payload = body(max_tokens=1, stream=True, kv_transfer_params=PREFILL_ASK)
        answer = await prod.post("/v1/completions", json=payload)
        assert answer.status_code == 200 and usage(serving_of(prod)) == 0


class SlowFirstPull(httpx.AsyncBaseTransport):
    """The producer's app, but the first call never answers (a pull still on its way)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.calls = inner, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls == 1:
            await asyncio.Event().wait()
        return await self.inner.handle_async_request(request)


class LeavingClient:
    """Just what ``until_disconnected`` reads of a request: its client leaves at once."""

    class url:
        path = "/v1/completions"

    async def receive(self) -> dict[str, str]:
        await asyncio.sleep(0)
        return {"type": "http.disconnect"}


async def test_a_client_leaving_during_the_pull_still_frees_the_producers_blocks() -> None:
    from app.api import kv_transfer
    from app.api.streaming import ClientGone

    async with pair() as (prod, cons):
        params = await prefill(prod)
        assert usage(serving_of(prod)) > 0
        serving = serving_of(cons)
        transfer = serving.kv_transfer
        assert transfer is not None
        producer_app = prod.asgi_app  # type: ignore[attr-defined]
        slow = SlowFirstPull(httpx.ASGITransport(app=producer_app))
        transfer._client = httpx.AsyncClient(transport=slow)
        want = kv_transfer.intent(serving, params)
        with pytest.raises(ClientGone):
            await kv_transfer.receive(LeavingClient(), serving, want, 50)  # type: ignore[arg-type]
        await asyncio.gather(*transfer._releases)  # the release fetch, in the background
        assert usage(serving_of(prod)) == 0


@pytest.mark.parametrize(("consumer_key", "note"), [("k1", "pulled"), (None, "fallback")])
async def test_a_producer_behind_an_api_key_takes_pulls_carrying_it(
    consumer_key: str | None, note: str
) -> None:
    keys = {"api_key": [consumer_key]} if consumer_key else {}
    auth = {"authorization": "Bearer k1"}
    async with pair(consumer=keys, api_key=["k1"]) as (prod, cons):
        ask = body(max_tokens=1, kv_transfer_params=PREFILL_ASK)
        params = (await prod.post("/v1/completions", json=ask, headers=auth)).json()
        answer = await cons.post(
            "/v1/completions", json=body(kv_transfer_params=params["kv_transfer_params"]),
            headers=auth if consumer_key else None,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kv-transfer"].startswith(note)
        assert (usage(serving_of(prod)) == 0) == (consumer_key is not None)


def test_a_wrong_config_or_a_real_model_is_refused_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from app.cli import parse
    from app.config import Settings
    from app.engine.errors import UnsupportedFeatureError

    with pytest.raises(SystemExit) as exit_info:
        parse(["serve", "--kv-transfer-config", '{"kv_connector":"NixlConnector"}'])
    assert exit_info.value.code == 2 and "kv_role" in capsys.readouterr().err
    config = NIXL.format(role="kv_both", id="x")
    with pytest.raises(UnsupportedFeatureError, match="mocks only"):
        Serving(Settings(model="smollm2", kv_transfer_config=config))


async def test_pulled_blocks_join_the_consumers_prefix_cache() -> None:
    """As on a vLLM decoder: the pulled prompt blocks are the consumer's cache now, so the same
    prompt again starts after them."""
    async with pair(consumer={"enable_prefix_caching": True}) as (prod, cons):
        params = await prefill(prod)
        await cons.post("/v1/completions", json=body(kv_transfer_params=params))
        consumer = serving_of(cons)
        assert metric(consumer, "vllm:prefix_cache_hits_total") == 0
        again = await cons.post("/v1/completions", json=body())
        full_blocks = (again.json()["usage"]["prompt_tokens"] - 1) // 4
        assert metric(consumer, "vllm:prefix_cache_hits_total") == full_blocks * 4


@pytest.mark.parametrize(
    "extra", [{"n": 3, "temperature": 1}, {"prompt": [PROMPT, PROMPT + " again"]}]
)
async def test_only_the_blocks_the_answer_names_are_held(extra: dict[str, Any]) -> None:
    async with pair() as (prod, _):
        payload = body(max_tokens=1, kv_transfer_params=PREFILL_ASK) | extra
        answer = await prod.post("/v1/completions", json=payload)
        assert answer.status_code == 200, answer.text
        params = answer.json()["kv_transfer_params"]
        ask = {"engine_id": "prod", "request_id": params["remote_request_id"]}
        assert (await prod.post("/v1/kv_transfer/fetch", json=ask)).status_code == 200
        assert usage(serving_of(prod)) == 0  # the other choices hold nothing until expiry


async def test_a_full_consumer_refuses_before_pulling_so_the_blocks_stay_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with pair() as (prod, cons):
        params = await prefill(prod)
        monkeypatch.setattr(serving_of(cons).engine.core, "has_room", lambda: False)
        answer = await cons.post("/v1/completions", json=body(kv_transfer_params=params))
        assert answer.status_code == 429, answer.text
        assert usage(serving_of(prod)) > 0  # a retry elsewhere can still pull them
