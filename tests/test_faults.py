"""Failure injection (--failure-rate, --failure-mid-stream-rate, fault headers): every injected
failure must look like the real failure of its kind, byte for byte, except where the real one
names request-specific values; it must hold no slot and be counted apart from real failures."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest
from conftest import ClientFactory, serving_of
from sse import parse_sse

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
    assert real.json()["error"]["code"] == "draining"
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
    assert real.json()["error"]["code"] == "context_length_exceeded"
    assert "+ max_tokens (10) exceeds the context length of 100" in injected.text
    same(real, injected, mask=lambda text: re.sub(r"\d+", "N", text))


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT_STREAM])
async def test_injected_model_not_found_is_the_real_404(
    make_client: ClientFactory, path: str, body: dict[str, object]
) -> None:
    async with make_client(allow_fault_headers=True) as client:
        real = await client.post(path, json=body | {"model": "gpt-9"})
        injected = await client.post(path, json=body, headers={FAIL: "model_not_found"})
    assert real.json()["error"]["code"] == "model_not_found"
    same(real, injected, mask=lambda text: text.replace("gpt-9", "slotserve-mock"))


async def test_injected_model_not_found_on_the_native_route_names_the_served_model(
    make_client: ClientFactory,
) -> None:
    async with make_client(allow_fault_headers=True) as client:
        path, body = NATIVE
        r = await client.post(path, json=body, headers={FAIL: "model_not_found"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
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
