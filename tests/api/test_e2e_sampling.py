"""The official ``openai`` client reads log probabilities and ``n`` choices from a real
server (uvicorn on 127.0.0.1, the mock), streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_process import ServerProcess, running_server

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Hello"}
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--num-slots", "8", "--max-n", "4", "--mock-step-ms", "2") as server:
        yield server


async def test_openai_client_reads_chat_logprobs_and_n_choices(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    chat = await client.chat.completions.create(
        model="slotserve-mock", messages=MESSAGES, max_tokens=8, n=3, seed=1,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1, 2]
    for choice in chat.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert chat.usage is not None and chat.usage.completion_tokens == 3 * 8
    stream = await client.chat.completions.create(
        model="slotserve-mock", messages=MESSAGES, max_tokens=8, n=3, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True},
    )  # fmt: skip
    texts = ["", "", ""]
    tokens: list[list[str]] = [[], [], []]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content is not None:
                tokens[c.index] += [t.token for t in c.logprobs.content]
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 3 * 8
    assert texts == [c.message.content for c in chat.choices]
    assert ["".join(t) for t in tokens] == texts
    await client.close()


async def test_openai_client_reads_completion_logprobs_echo_and_n(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    scored = await client.completions.create(
        model="slotserve-mock", prompt="Once upon a time", max_tokens=0, echo=True, logprobs=1
    )
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert scored.choices[0].text == "Once upon a time"
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == 16
    whole = await client.completions.create(
        model="slotserve-mock", prompt="Once ", max_tokens=6, n=2, best_of=2, logprobs=3
    )
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert "".join(choice.logprobs.tokens) == choice.text
    texts = ["", ""]
    async for chunk in await client.completions.create(
        model="slotserve-mock", prompt="Once ", max_tokens=6, n=2, logprobs=3, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="slotserve-mock", prompt="x", n=5)
    assert refused.value.body["param"] is None  # as vLLM: its check of n names no param
    assert refused.value.response.headers["x-slotserve-error-param"] == "n"
    await client.close()


async def test_one_cancel_ends_every_choice(
    server: ServerProcess,
) -> None:
    body = {"prompt": "Tell me ", "max_tokens": 5000, "n": 3, "seed": 7, "stream": True,
            "ignore_eos": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            request_id = await _every_choice_started(lines, 3)
            slots = (await client.get("/slots")).json()["slots"]
            running = sorted(s["request_id"] for s in slots if s["is_processing"])
            assert running == [request_id, f"{request_id}~1", f"{request_id}~2"]
            assert (await client.delete(f"/requests/{request_id}")).status_code == 200
            slots = (await client.get("/slots")).json()["slots"]
            assert not any(s["is_processing"] for s in slots)
            reasons = {}
            async for line in lines:
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice["finish_reason"]:
                            reasons[choice["index"]] = choice["finish_reason"]
        assert reasons == {0: "abort", 1: "abort", 2: "abort"}


async def _every_choice_started(lines: Any, n: int) -> str:
    """Read SSE lines until each of the ``n`` choices has sent a chunk; returns the id."""
    started: set[int] = set()
    async for line in lines:
        if line.startswith("data: {"):
            data = json.loads(line[6:])
            started.update(choice["index"] for choice in data["choices"])
            if len(started) == n:
                return str(data["id"])
    raise AssertionError("the stream ended before every choice started")
