"""Failure injection (--failure-rate, --failure-mid-stream-rate, fault headers): every injected
failure must look like the real failure of its kind, byte for byte, except where the real one
names request-specific values; it must hold no slot and be counted apart from real failures."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable

import httpx
import pytest
from conftest import ClientFactory, serving_of
from error_shape import field_of
from sse import parse_sse

from app.api.faults import FaultInjector
from app.cli import parse
from app.config import FAILURE_TYPES, Settings
from app.metrics import EngineMetrics
from app.serving import GenerationParams

FAIL = "x-slotserve-fail"
FAIL_AFTER = "x-slotserve-fail-after"
NATIVE = ("/generate", {"prompt": "hello", "max_tokens": 5, "stream": False})
COMPLETION = ("/v1/completions", {"model": "slotserve-mock", "prompt": "hello", "max_tokens": 5})
CHAT_STREAM = (
    "/v1/chat/completions",
    {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "stream": True},
)
ROUTES = [NATIVE, COMPLETION, CHAT_STREAM]
IDS = re.compile(r"\b(gen|cmpl|chatcmpl)-[0-9a-f]{32}\b")


def same(real: httpx.Response, injected: httpx.Response, mask: Callable[[str], str] = str) -> None:
    """Same status, same headers and the same body once ``mask`` hides request-specific values
    (with no mask, the same bytes)."""
    assert injected.status_code == real.status_code
    if mask is str:
        assert injected.content == real.content
        assert injected.headers.multi_items() == real.headers.multi_items()
    else:
        assert mask(injected.text) == mask(real.text)
        drop = {"content-length"}
        assert [h for h in injected.headers.multi_items() if h[0] not in drop] == [
            h for h in real.headers.multi_items() if h[0] not in drop
        ]


def anonymous(text: str) -> str:
    """Hide request ids, timestamps and the failed model call's exception."""
    text = IDS.sub("ID", text)
    text = re.sub(r'"created":\s*\d+', '"created":0', text)
    return re.sub(r"model call failed: [^\"]*", "model call failed: E", text)


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_injected_rate_limit_is_the_real_429(
    make_client: ClientFactory, path: str, body: dict[str, object]
) -> None:
    settings = {"num_slots": 1, "max_waiting": 0, "mock_step_ms": 2, "allow_fault_headers": True}
    async with make_client(**settings) as client:
        injected = await client.post(path, json=body, headers={FAIL: "rate_limit"})
        serving = serving_of(client)
        holder = serving.submit(GenerationParams(prompt=[65], max_tokens=5000, ignore_eos=True))
        await anext(holder)  # it holds the only slot: the next request is really refused
        real = await client.post(path, json=body)
        serving.abort(holder.request_id)
    assert real.status_code == 429 and real.headers["retry-after"] == "1"
    same(real, injected)


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_injected_engine_overloaded_is_the_real_503_while_draining(
    make_client: ClientFactory, path: str, body: dict[str, object]
) -> None:
    async with make_client(allow_fault_headers=True) as client:
        injected = await client.post(path, json=body, headers={FAIL: "engine_overloaded"})
        await serving_of(client).stop()
        real = await client.post(path, json=body)
    assert real.status_code == 503 and real.headers["retry-after"] == "1"
    assert real.headers["x-slotserve-error-code"] == "draining"
    same(real, injected)


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_injected_invalid_api_key_is_the_real_401(
    make_client: ClientFactory, path: str, body: dict[str, object]
) -> None:
    async with make_client(api_key="right", allow_fault_headers=True) as client:
        real = await client.post(path, json=body, headers={"authorization": "Bearer wrong"})
        good = {"authorization": "Bearer right", FAIL: "invalid_api_key"}
        injected = await client.post(path, json=body, headers=good)
    assert real.status_code == 401 and real.headers["www-authenticate"] == "Bearer"
    same(real, injected)


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_injected_context_length_is_the_real_400_with_the_requests_own_figures(
    make_client: ClientFactory, path: str, body: dict[str, object]
) -> None:
    async with make_client(max_model_len=100, allow_fault_headers=True) as client:
        real = await client.post(path, json=body | {"max_tokens": 99})
        fits = body | {"max_tokens": 10}
        injected = await client.post(path, json=fits, headers={FAIL: "context_length"})
    assert real.headers["x-slotserve-error-code"] == "context_length_exceeded"
    assert "+ max_tokens (10) exceeds the context length of 100" in injected.text
    same(real, injected, mask=lambda text: re.sub(r"\d+", "N", text))


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT_STREAM])
async def test_injected_model_not_found_is_the_real_404(
    make_client: ClientFactory, path: str, body: dict[str, object]
) -> None:
    async with make_client(allow_fault_headers=True) as client:
        real = await client.post(path, json=body | {"model": "gpt-9"})
        injected = await client.post(path, json=body, headers={FAIL: "model_not_found"})
    assert real.headers["x-slotserve-error-code"] == "model_not_found"
    same(real, injected, mask=lambda text: text.replace("gpt-9", "slotserve-mock"))


async def test_injected_model_not_found_on_the_native_route_names_the_served_model(
    make_client: ClientFactory,
) -> None:
    async with make_client(allow_fault_headers=True) as client:
        path, body = NATIVE
        r = await client.post(path, json=body, headers={FAIL: "model_not_found"})
    assert r.status_code == 404 and field_of(r.json()["error"]) == "model"
    assert "'slotserve-mock' does not exist" in r.json()["error"]["message"]


class FailingModel:
    """A real model failure: raises at once for a prompt holding 'Z', and for one holding 'X'
    once it has 3 generated tokens; every other sequence gets 'A' forever."""

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        for prefix in batch:
            if ord("Z") in prefix or (ord("X") in prefix and prefix[-3:] == [ord("A")] * 3):
                raise RuntimeError("boom")
        return [ord("A")] * len(batch)


ERROR_ROUTES = [
    ("/generate", {"max_tokens": 10}),
    ("/generate", {"max_tokens": 10, "stream": False}),
    ("/v1/completions", {"max_tokens": 10}),
    ("/v1/completions", {"max_tokens": 10, "stream": True}),
    ("/v1/chat/completions", {"max_tokens": 10, "stream": True}),
    ("/v1/chat/completions", {"max_tokens": 10}),
]


@pytest.mark.parametrize(("path", "body"), ERROR_ROUTES)
async def test_injected_server_error_is_the_real_model_failure(
    make_client: ClientFactory, path: str, body: dict[str, object]
) -> None:
    async with make_client(model=FailingModel(), allow_fault_headers=True) as client:
        real = await client.post(path, json=_ask(path, body, "Z"))
        injected = await client.post(
            path, json=_ask(path, body, "Y"), headers={FAIL: "server_error"}
        )
    assert "boom" in real.text and "server_error" in injected.text
    same(real, injected, mask=anonymous)


@pytest.mark.parametrize(("path", "body"), ERROR_ROUTES)
async def test_an_injected_break_after_n_tokens_is_the_real_mid_stream_model_failure(
    make_client: ClientFactory, path: str, body: dict[str, object]
) -> None:
    async with make_client(model=FailingModel(), allow_fault_headers=True) as client:
        real = await client.post(path, json=_ask(path, body, "X"))
        headers = {FAIL_AFTER: "3"}
        injected = await client.post(path, json=_ask(path, body, "Y"), headers=headers)
    assert "boom" in real.text
    if real.headers["content-type"].startswith("text/event-stream"):
        assert _outline(injected.text) == _outline(real.text)
        assert _outline(real.text)[0] == "AAA" and "[DONE]" not in real.text
    else:
        same(real, injected, mask=anonymous)


def _ask(path: str, body: dict[str, object], prompt: str) -> dict[str, object]:
    """``body`` with ``prompt`` as its prompt (or its chat message)."""
    if path == "/v1/chat/completions":
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


def _outline(body: str) -> tuple[str, list[tuple[str, object]]]:
    """An SSE body as (its generated text, its other events, anonymous). How tokens are split
    between events is timing (a slow reader gets merged deltas), not behaviour."""
    text, others = "", []
    for event in parse_sse(anonymous(body)):
        data = event.data
        choice = data["choices"][0] if isinstance(data, dict) and data.get("choices") else {}
        piece = (
            data["text"]
            if event.event == "token"
            else choice.get("text") or choice.get("delta", {}).get("content")
        )
        if piece and (event.event == "token" or choice.get("finish_reason") is None):
            text += piece
        else:
            others.append((event.event, data))
    return text, others


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text ``text``."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name, labels)


async def test_every_failure_type_is_exported_at_zero(make_client: ClientFactory) -> None:
    async with make_client() as client:
        text = (await client.get("/metrics")).text
    for kind in (*FAILURE_TYPES, "mid_stream"):
        assert metric(text, "slotserve:injected_failures_total", type=kind) == 0


STATUSES = {
    "rate_limit": 429,
    "invalid_api_key": 401,
    "context_length": 400,
    "model_not_found": 404,
    "engine_overloaded": 503,
}


async def test_injected_failures_hold_no_slot_and_are_counted_apart_from_real_ones(
    make_client: ClientFactory,
) -> None:
    settings = {"num_slots": 1, "max_waiting": 0, "mock_step_ms": 2, "allow_fault_headers": True}
    async with make_client(**settings) as client:
        serving = serving_of(client)
        holder = serving.submit(GenerationParams(prompt=[65], max_tokens=5000, ignore_eos=True))
        await anext(holder)  # the only slot is busy and nothing may wait
        stream = {"prompt": "hi", "max_tokens": 5}
        r = await client.post("/generate", json=stream, headers={FAIL: "server_error"})
        assert r.status_code == 200 and [e.event for e in parse_sse(r.text)] == ["error"]
        for kind, status in STATUSES.items():  # answered, although nothing can be queued
            r = await client.post("/generate", json=stream, headers={FAIL: kind})
            assert r.status_code == status
        assert serving.engine.core.num_waiting == 0
        serving.abort(holder.request_id)
        text = (await client.get("/metrics")).text
    assert metric(text, "slotserve:injected_failures_total", type="server_error") == 1
    for kind in STATUSES:
        assert metric(text, "slotserve:injected_failures_total", type=kind) == 1
    assert metric(text, "slotserve:model_call_failures_total") == 0  # exported at 0
    rejected = [line for line in text.splitlines() if line.startswith("slotserve:requests_rej")]
    assert rejected and all(line.endswith(" 0.0") for line in rejected)


async def test_a_broken_stream_frees_its_slot_and_counts_as_mid_stream_not_a_model_failure(
    make_client: ClientFactory,
) -> None:
    settings = {"num_slots": 1, "mock_step_ms": 1, "allow_fault_headers": True}
    async with make_client(**settings) as client:
        serving = serving_of(client)
        long = {"prompt": "hi", "max_tokens": 5000, "ignore_eos": True}
        async with client.stream("POST", "/generate", json=long, headers={FAIL_AFTER: "2"}) as r:
            body = (await r.aread()).decode()
        events = parse_sse(body)
        assert len([t for e in events if e.event == "token" for t in e.data["tokens"]]) == 2
        assert events[-1].event == "error"
        await asyncio.wait_for(serving.engine.wait_idle(), 5)  # aborted, not run to 5000
        assert serving.engine.core.num_running == 0
        ok = await client.post("/generate", json={"prompt": "hi", "max_tokens": 3, "stream": False})
        assert ok.status_code == 200
        text = (await client.get("/metrics")).text
    assert metric(text, "slotserve:injected_failures_total", type="mid_stream") == 1
    assert metric(text, "slotserve:model_call_failures_total") == 0
    assert metric(text, "vllm:generation_tokens_total") < 100


async def test_a_break_after_zero_tokens_sends_only_the_error(make_client: ClientFactory) -> None:
    async with make_client(allow_fault_headers=True) as client:
        body = {"model": "slotserve-mock", "prompt": "hi", "max_tokens": 50, "stream": True}
        r = await client.post("/v1/completions", json=body, headers={FAIL_AFTER: "0"})
    (error,) = parse_sse(r.text)
    assert (error.data["error"]["type"], error.data["error"]["code"]) == (
        "InternalServerError",
        500,
    )
    assert error.data["error"]["message"].startswith("model call failed")


@pytest.mark.parametrize("header", [FAIL, FAIL_AFTER])
@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_fault_headers_are_refused_without_allow_fault_headers(
    make_client: ClientFactory, header: str, path: str, body: dict[str, object]
) -> None:
    value = "rate_limit" if header == FAIL else "3"
    async with make_client() as client:
        r = await client.post(path, json=body, headers={header: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (
        r.headers["x-slotserve-error-code"] == "fault_headers_not_allowed"
        and field_of(error) == header
    )
    assert "--allow-fault-headers" in error["message"]


@pytest.mark.parametrize(
    ("header", "value"),
    [(FAIL, "teapot"), (FAIL, ""), (FAIL_AFTER, "-1"), (FAIL_AFTER, "2.5"), (FAIL_AFTER, "x")],
)
async def test_a_bad_fault_header_is_a_400_naming_it(
    make_client: ClientFactory, header: str, value: str
) -> None:
    async with make_client(allow_fault_headers=True) as client:
        r = await client.post("/generate", json=NATIVE[1], headers={header: value})
    assert r.status_code == 400
    assert field_of(r.json()["error"]) == header and header in r.json()["error"]["message"]


async def test_a_real_error_wins_over_an_injected_one(make_client: ClientFactory) -> None:
    async with make_client(allow_fault_headers=True, failure_rate=1.0) as client:
        too_long = {"prompt": "hi", "max_tokens": 9000}
        r = await client.post("/generate", json=too_long, headers={FAIL: "rate_limit"})
    assert r.status_code == 400 and r.headers["x-slotserve-error-code"] == "context_length_exceeded"


N_DRAWS = 2000


@pytest.mark.parametrize("rate", [0.01, 0.1, 0.5, 0.9])
def test_the_share_of_failed_requests_is_the_failure_rate(rate: float) -> None:
    """Over 2,000 seeded requests, the share failed is within 3 standard deviations of F,
    and so is each type's share of F / number of types."""
    types = "rate_limit,server_error,engine_overloaded"
    settings = Settings(failure_rate=rate, failure_types=types, seed=7)
    injector = FaultInjector(settings, EngineMetrics("m", 1))
    draws = [injector.draw_failure() for _ in range(N_DRAWS)]
    assert within_3_sd(sum(d is not None for d in draws), N_DRAWS, rate)
    for kind in types.split(","):
        assert within_3_sd(draws.count(kind), N_DRAWS, rate / 3)


def within_3_sd(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= 3 * math.sqrt(n * p * (1 - p))


async def test_the_failure_rate_applies_to_served_requests(make_client: ClientFactory) -> None:
    """The decision above is what the routes use: F of the requests fail, each with its
    real status, and the metric counts them."""
    n, rate = 300, 0.5
    types = "rate_limit,server_error,engine_overloaded"
    async with make_client(failure_rate=rate, failure_types=types, seed=3) as client:
        body = {"prompt": "hi", "max_tokens": 1, "stream": False}
        statuses = [(await client.post("/generate", json=body)).status_code for _ in range(n)]
        text = (await client.get("/metrics")).text
    assert within_3_sd(sum(status != 200 for status in statuses), n, rate)
    for kind, status in (("rate_limit", 429), ("server_error", 500), ("engine_overloaded", 503)):
        counted = metric(text, "slotserve:injected_failures_total", type=kind)
        assert counted == statuses.count(status) > 0


def test_the_same_seed_injects_the_same_failures() -> None:
    def draws(seed: int) -> list[str | None]:
        settings = Settings(failure_rate=0.3, seed=seed)
        injector = FaultInjector(settings, EngineMetrics("m", 1))
        return [injector.draw_failure() for _ in range(200)]

    assert draws(1) == draws(1) != draws(2)
    assert set(draws(1)) == {None, *FAILURE_TYPES}


def test_a_server_that_injects_failures_says_so_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="slotserve.faults"):
        FaultInjector(Settings(), EngineMetrics("m", 1))
        assert caplog.records == []
        FaultInjector(Settings(failure_rate=0.25), EngineMetrics("m", 1))
    (record,) = caplog.records
    assert "failure injection is on: failure rate 0.25" in record.getMessage()


def test_the_fault_flags_are_also_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_ALLOW_FAULT_HEADERS", "true")
    monkeypatch.setenv("SLOTSERVE_FAILURE_TYPES", "rate_limit")
    _, settings = parse(["serve"])
    assert settings.allow_fault_headers and settings.failure_types == "rate_limit"
    assert not parse(["serve", "--no-allow-fault-headers"])[1].allow_fault_headers


@pytest.mark.parametrize("value", ["rate_limit,teapot", "", " , "])
def test_an_unknown_failure_type_is_a_one_line_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(["serve", "--failure-types", value])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("slotserve: error: --failure-types (SLOTSERVE_FAILURE_TYPES)")
    assert "rate_limit, invalid_api_key" in message


def test_fault_flags_parse() -> None:
    _, settings = parse(
        ["serve", "--failure-rate", "0.2", "--failure-types", " server_error , rate_limit",
         "--failure-mid-stream-rate", "0.1", "--allow-fault-headers"]
    )  # fmt: skip
    assert (settings.failure_rate, settings.failure_mid_stream_rate) == (0.2, 0.1)
    assert settings.failure_types == "server_error,rate_limit" and settings.allow_fault_headers
    assert not parse(["serve"])[1].allow_fault_headers
