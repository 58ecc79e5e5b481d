"""Tool calls read the same way on every route: the same model text, sent through chat
completions, the Responses API and the Messages API, whole and streamed, gives the same calls
(under ``auto``: a call to a tool that was not offered, or several calls with parallel calls
turned off, stay content, as chat always read them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from conftest import app_client
from prometheus_client.parser import text_string_to_metric_families
from sse import parse_sse

from app.models.mock import MockModel
from app.models.mock_language import MockLanguage

CUE = b"\nassistant: "  # the mock chat template's last line: the reply follows it
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
Calls = list[tuple[str, Any]]


@dataclass(frozen=True, slots=True)
class Scripted(MockLanguage):
    """Writes ``script`` after the chat template's cue, then the stop token."""

    script: bytes = b""

    def next_token(self, prefix: Sequence[int]) -> int:
        text = bytes(t for t in prefix if t < 256)
        written = len(text) - (text.rindex(CUE) + len(CUE))
        return self.script[written] if written < len(self.script) else self.stop_token


def block(name: str, city: str) -> str:
    call = {"name": name, "arguments": {"city": city}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


ONE = "Let me look.\n" + block("weather", "Paris")
NOT_OFFERED = "Let me look.\n" + block("stocks", "Paris")
TWO = block("weather", "Paris") + "\n" + block("weather", "Rome")


async def chat(client: httpx.AsyncClient, parallel: bool, stream: bool) -> Calls:
    tool = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 300,
            "tools": [tool], "parallel_tool_calls": parallel, "stream": stream}  # fmt: skip
    reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    if not stream:
        listed = reply.json()["choices"][0]["message"].get("tool_calls") or []
        return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in listed]
    calls: dict[int, list[str]] = {}
    for event in parse_sse(reply.text):
        if not isinstance(event.data, dict):
            continue  # [DONE]
        for delta in event.data["choices"][0]["delta"].get("tool_calls") or []:
            entry = calls.setdefault(delta["index"], ["", ""])
            entry[0] += delta["function"].get("name") or ""
            entry[1] += delta["function"].get("arguments") or ""
    return [(name, json.loads(arguments)) for name, arguments in calls.values()]


async def responses(client: httpx.AsyncClient, parallel: bool, stream: bool) -> Calls:
    tool = {"type": "function", "name": "weather", "parameters": SCHEMA}
    body = {"input": "Weather?", "max_output_tokens": 300, "tools": [tool],
            "parallel_tool_calls": parallel, "stream": stream}  # fmt: skip
    reply = await client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    final = parse_sse(reply.text)[-1].data["response"] if stream else reply.json()
    items = [item for item in final["output"] if item["type"] == "function_call"]
    return [(item["name"], json.loads(item["arguments"])) for item in items]


async def messages(client: httpx.AsyncClient, parallel: bool, stream: bool) -> Calls:
    tool = {"name": "weather", "input_schema": SCHEMA}
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 300,
            "tools": [tool], "stream": stream,
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": not parallel}}  # fmt: skip
    reply = await client.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    if not stream:
        uses = [b for b in reply.json()["content"] if b["type"] == "tool_use"]
        return [(use["name"], use["input"]) for use in uses]
    calls: list[list[str]] = []
    for event in parse_sse(reply.text):
        if (
            event.event == "content_block_start"
            and event.data["content_block"]["type"] == "tool_use"
        ):
            calls.append([event.data["content_block"]["name"], ""])
        elif (
            event.event == "content_block_delta"
            and event.data["delta"]["type"] == "input_json_delta"
        ):
            calls[-1][1] += event.data["delta"]["partial_json"]
    return [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize(
    ("script", "parallel", "expected"),
    [
        (ONE, True, [("weather", {"city": "Paris"})]),
        (NOT_OFFERED, True, []),  # a tool that was not offered: the text stays content
        (TWO, True, [("weather", {"city": "Paris"}), ("weather", {"city": "Rome"})]),
        (TWO, False, []),  # two calls, parallel calls turned off: content
    ],
    ids=["one-call", "not-offered", "two-calls", "two-calls-not-parallel"],
)
async def test_the_same_text_gives_the_same_calls_on_every_route(
    script: str, parallel: bool, expected: Calls
) -> None:
    model = MockModel(Scripted(script=script.encode()))
    async with app_client(model, num_slots=4) as client:
        for stream in (False, True):
            for route in (chat, responses, messages):
                assert await route(client, parallel, stream) == expected, (route, stream)


def parser_counts(metrics: str) -> dict[tuple[str, str, str], float]:
    """``vllm:tool_call_parser_invocations_total`` on /metrics: (mode, outcome, request_type)
    -> value, each series checked to carry vLLM's labels (no ``engine``: one per process)."""
    counts = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "vllm:tool_call_parser_invocations":
            continue
        for sample in family.samples:
            labels = sample.labels
            assert set(labels) == {"model_name", "mode", "outcome", "request_type"}, labels
            counts[labels["mode"], labels["outcome"], labels["request_type"]] = sample.value
    return counts


async def test_tool_parser_invocations_count_as_vllms() -> None:
    """vLLM's counter: every series at 0 from the start; a reply read whole counts once per
    choice, a streamed one once per delta read (those with a call's part: ``tool_call``), under
    the route's request type (Messages: ``other``); no tools offered, nothing is read."""
    model = MockModel(Scripted(script=ONE.encode()))
    async with app_client(model, num_slots=4) as client:
        start = parser_counts((await client.get("/metrics")).text)
        assert len(start) == 12 and set(start.values()) == {0.0}
        for route in (chat, responses, messages):
            await route(client, True, False)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        whole = parser_counts((await client.get("/metrics")).text)
        moved = {series: value for series, value in whole.items() if value}
        assert moved == {
            ("non_streaming", "tool_call", request_type): 1.0
            for request_type in ("chat_completions", "responses", "other")
        }
        await chat(client, True, True)
        await responses(client, True, True)
        streamed = parser_counts((await client.get("/metrics")).text)
    for request_type in ("chat_completions", "responses"):
        # "Let me look.\n" is text, then the call block, whose parts come out when it closes
        calls = streamed["streaming", "tool_call", request_type]
        text = streamed["streaming", "no_tool_call", request_type]
        assert calls == 1 and text >= 1, (request_type, calls, text)
        assert calls + text <= len(ONE) + 1  # at most one read per token (and the end's)
    assert streamed["streaming", "tool_call", "other"] == 0  # messages was not streamed
    assert {k: v for k, v in streamed.items() if k[0] == "non_streaming"} == {
        k: v for k, v in whole.items() if k[0] == "non_streaming"
    }
