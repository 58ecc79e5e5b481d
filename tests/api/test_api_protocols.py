"""/v1/messages (Anthropic) and /v1/responses (OpenAI) through the ASGI app: both are adapters
over the one internal request, so their text equals chat completions' for the same
conversation. The official clients run against a real server in test_protocol_clients."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from conftest import ClientFactory, app_client, serving_of
from error_shape import field_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sse import Event, parse_sse

from app.api.adapters.anthropic_errors import AnthropicErrors
from app.api.adapters.responses_store import ResponseStore, Stored

USER = [{"role": "user", "content": "Tell me a story"}]
ANTHROPIC_EVENTS = ["message_start", "content_block_start"]  # no ping, as vLLM
ANTHROPIC_END = ["content_block_stop", "message_delta", "message_stop"]


async def chat_text(client: httpx.AsyncClient, max_tokens: int, system: str = "") -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + USER
    body = {"messages": messages, "max_tokens": max_tokens}
    reply = (await client.post("/v1/chat/completions", json=body)).json()
    return str(reply["choices"][0]["message"]["content"])


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body["error"]) == {"type", "message"}
    return str(body["error"]["message"])


async def test_a_message_is_chat_completions_text_in_anthropics_shape(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        expected = await chat_text(client, 30, system="Be brief")
        body = {"model": "slotserve-mock", "max_tokens": 30, "messages": USER,
                "system": [{"type": "text", "text": "Be brief"}]}  # fmt: skip
        message = (await client.post("/v1/messages", json=body)).json()
        assert message["type"] == "message" and message["role"] == "assistant"
        assert message["content"] == [{"type": "text", "text": expected}]
        full = message["usage"]["output_tokens"] == 30
        assert message["stop_reason"] == ("max_tokens" if full else "end_turn")
        assert message["stop_sequence"] is None
        counted = (await client.post("/v1/messages/count_tokens", json=body)).json()
        assert counted == {"input_tokens": message["usage"]["input_tokens"]}


async def test_a_system_message_in_messages_is_a_system_turn_as_vllm_answers(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        body = {"max_tokens": 4, "messages": [{"role": "system", "content": "Hi"}, *USER]}
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        prompt = serving_of(client).tokenizer.chat_prompt(
            [("system", "Hi"), ("user", USER[0]["content"])]
        )
        # vLLM's usage: the token counts only, no cache counters
        assert r.json()["usage"] == {"input_tokens": len(prompt), "output_tokens": 4}
        empty = {"max_tokens": 4, "messages": [{"role": "system", "content": ""}, *USER]}
        r = await client.post("/v1/messages/count_tokens", json=empty)
        assert r.json()["input_tokens"] == len(serving_of(client).tokenizer.chat_prompt(
            [("user", USER[0]["content"])]))  # an empty one is dropped  # fmt: skip


async def test_a_streamed_message_has_anthropics_event_sequence(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        whole = (
            await client.post("/v1/messages", json={"max_tokens": 500, "messages": USER})
        ).json()
        r = await client.post(
            "/v1/messages", json={"max_tokens": 500, "messages": USER, "stream": True}
        )
        events = parse_sse(r.text)
        names = [e.event for e in events]
        assert names[:2] == ANTHROPIC_EVENTS and names[-3:] == ANTHROPIC_END
        assert set(names[2:-3]) == {"content_block_delta"}
        assert all(e.data["type"] == e.event for e in events)
        deltas = [e.data["delta"] for e in events[2:-3]]
        assert all(d["type"] == "text_delta" for d in deltas)
        assert "".join(d["text"] for d in deltas) == whole["content"][0]["text"]
        start, end = events[0].data["message"], events[-2].data
        assert start["id"] != whole["id"] and start["usage"]["input_tokens"] > 0
        assert end["delta"]["stop_reason"] == whole["stop_reason"] == "end_turn"
        assert end["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
        assert end["usage"]["input_tokens"] == whole["usage"]["input_tokens"]  # as vLLM sends it


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(start=st.integers(0, 59), length=st.integers(1, 4))
def test_stop_sequences_cut_the_text_before_the_first_match(start: int, length: int) -> None:
    asyncio.run(check_stop_sequence(start, length))


async def check_stop_sequence(start: int, length: int) -> None:
    async with app_client() as client:
        whole = (
            await client.post("/v1/messages", json={"max_tokens": 60, "messages": USER})
        ).json()["content"][0]["text"]
        stop = whole[start : start + length]
        if not stop:
            return
        body = {"max_tokens": 60, "messages": USER, "stop_sequences": [stop]}
        message = (await client.post("/v1/messages", json=body)).json()
        text = message["content"][0]["text"] if message["content"] else ""
        assert text == whole[: whole.find(stop)]  # the plain reference
        assert message["stop_reason"] == "stop_sequence"
        assert message["stop_sequence"] == stop


async def test_messages_bad_input_is_answered_in_anthropics_shape(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        post = client.post
        no_max = await post("/v1/messages", json={"messages": USER})
        assert "max_tokens" in anthropic_error(no_max, 400, "invalid_request_error")
        # integers read as on the OpenAI routes (vLLM's lax schema): "3" is 3
        r = await post("/v1/messages", json={"max_tokens": "3", "top_k": 2.0, "messages": USER})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3, r.text
        # a schema error's field once (main: "body.max_tokens: max_tokens: Input should ...")
        r = await post("/v1/messages", json={"max_tokens": "five", "messages": USER})
        message = anthropic_error(r, 400, "invalid_request_error")
        assert message.startswith("max_tokens: ") and message.count("max_tokens") == 1, message
        image = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
        r = await post("/v1/messages", json={"max_tokens": 5, "messages": image})
        assert "image" in anthropic_error(r, 400, "invalid_request_error")
        orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]
        r = await post("/v1/messages", json={"max_tokens": 5, "messages": orphan})
        assert "t1" in anthropic_error(r, 400, "invalid_request_error")
        # a result in a system turn (main: "answers no tool_use block", though one did ask)
        use = [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]
        held = [
            *USER,
            {"role": "assistant", "content": use},
            {"role": "system", "content": orphan[0]["content"]},
        ]
        r = await post("/v1/messages", json={"max_tokens": 5, "messages": held})
        assert "belongs in a user message" in anthropic_error(r, 400, "invalid_request_error")
        assert field_of(r) == "messages.2.content.0"
        r = await post("/v1/messages", json={"max_tokens": 5, "messages": USER, "model": "x"})
        anthropic_error(r, 404, "not_found_error")
        r = await post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
        anthropic_error(r, 400, "invalid_request_error")
        # the other routes keep the one OpenAI shape
        r = await post("/v1/chat/completions", json={"messages": USER, "model": "x"})
        assert r.status_code == 404 and r.headers["x-slotserve-error-code"] == "model_not_found"


async def test_a_tool_round_trip_in_history_reaches_the_prompt(make_client: ClientFactory) -> None:
    history = [
        *USER,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user",
         "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sun"}]},
    ]  # fmt: skip
    async with make_client() as client:
        r = await client.post("/v1/messages/count_tokens", json={"messages": history})
        short = await client.post("/v1/messages/count_tokens", json={"messages": USER})
        assert r.json()["input_tokens"] > short.json()["input_tokens"]
        call = {
            "id": "t1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
        }
        chat = [*USER, {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "t1", "content": "sun"}]  # fmt: skip
        reply = await client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 1})
        assert r.json()["input_tokens"] == reply.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("failure", "status", "kind"),
    [("rate_limit", 429, "rate_limit_error"), ("engine_overloaded", 529, "overloaded_error"),
     ("server_error", 500, "api_error"), ("invalid_api_key", 401, "authentication_error"),
     ("context_length", 400, "invalid_request_error")],
)  # fmt: skip
async def test_injected_failures_on_messages_are_anthropics_errors(
    make_client: ClientFactory, failure: str, status: int, kind: str
) -> None:
    async with make_client(allow_fault_headers=True) as client:
        r = await client.post("/v1/messages", json={"max_tokens": 5, "messages": USER},
                              headers={"x-slotserve-fail": failure})  # fmt: skip
        anthropic_error(r, status, kind)
        if status in (429, 529):
            assert r.headers["retry-after"] == "1"


async def test_a_stream_broken_midway_ends_with_each_protocols_error_event(
    make_client: ClientFactory,
) -> None:
    broken = {"x-slotserve-fail-after": "3"}
    async with make_client(allow_fault_headers=True) as client:
        body = {"max_tokens": 50, "messages": USER, "stream": True}
        events = parse_sse((await client.post("/v1/messages", json=body, headers=broken)).text)
        assert [e.event for e in events[:2]] == ANTHROPIC_EVENTS
        assert events[-1].event == "error"
        assert events[-1].data == {"type": "error", "error": {
            "type": "api_error", "message": events[-1].data["error"]["message"]}}  # fmt: skip
        assert "message_stop" not in [e.event for e in events]
        body = {"max_output_tokens": 50, "input": "hi", "stream": True}
        events = parse_sse((await client.post("/v1/responses", json=body, headers=broken)).text)
        assert events[-1].event == "response.failed"
        failed = events[-1].data["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        stored = (await client.get(f"/v1/responses/{failed['id']}")).json()
        assert stored["status"] == "failed"


async def test_x_api_key_authenticates_like_bearer_against_the_named_keys(
    make_client: ClientFactory,
) -> None:
    async with make_client(api_key=["alice:sk-alice"]) as client:
        body = {"max_tokens": 3, "messages": USER}
        anthropic_error(await client.post("/v1/messages", json=body), 401, "authentication_error")
        wrong = {"x-api-key": "sk-bob"}
        r = await client.post("/v1/messages", json=body, headers=wrong)
        anthropic_error(r, 401, "authentication_error")
        r = await client.post("/v1/messages", json=body, headers={"x-api-key": "sk-alice"})
        assert r.status_code == 200
        r = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3},
                              headers={"authorization": "Bearer sk-alice"})  # fmt: skip
        assert r.status_code == 200
        metrics = (await client.get("/metrics")).text
        line = next(
            m for m in metrics.splitlines()
            if m.startswith("vllm:request_success_total{") and 'key="alice"' in m
        )  # fmt: skip
        assert 'finished_reason="length"' in line and line.endswith(" 2.0")


def response_events(r: httpx.Response) -> list[Event]:
    events = parse_sse(r.text)
    assert [e.data["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e.data["type"] == e.event for e in events)
    return events


async def test_a_response_is_chat_completions_text_streamed_or_not(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        expected = await chat_text(client, 500, system="Be brief")
        body: dict[str, Any] = {"input": USER, "instructions": "Be brief",
                                "max_output_tokens": 500}  # fmt: skip
        whole = (await client.post("/v1/responses", json=body)).json()
        assert whole["status"] == "completed" and whole["object"] == "response"
        assert whole["output"][0]["content"][0]["text"] == expected
        events = response_events(await client.post("/v1/responses", json=body | {"stream": True}))
        names = [e.event for e in events]
        assert names[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]  # fmt: skip
        deltas = [e.data["delta"] for e in events if e.event == "response.output_text.delta"]
        assert "".join(deltas) == expected == events[-4].data["text"]
        final = events[-1].data["response"]
        assert final["usage"] == whole["usage"] and final["status"] == "completed"


async def test_max_output_tokens_ends_a_response_incomplete(make_client: ClientFactory) -> None:
    async with make_client() as client:
        body = {"input": "hi", "max_output_tokens": 4}
        whole = (await client.post("/v1/responses", json=body)).json()
        assert whole["status"] == "incomplete"
        assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
        assert whole["output"][0]["status"] == "completed"  # the item: as vLLM says
        events = response_events(await client.post("/v1/responses", json=body | {"stream": True}))
        # vLLM's end of any stream that did not fail: the status is in the response
        assert events[-1].event == "response.completed"
        assert events[-1].data["response"]["status"] == "incomplete"
        assert events[-2].data["item"]["status"] == "completed"


async def test_a_response_has_vllms_defaults_and_usage(make_client: ClientFactory) -> None:
    async with make_client() as client:
        whole = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        response = whole.json()
        # what the client did not send is null, as vLLM echoes it; no ``store`` field
        assert response["metadata"] is None and response["text"] is None
        assert "store" not in response
        usage = response["usage"]
        assert usage["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0,
                                                 "input_tokens_per_turn": [],
                                                 "cached_tokens_per_turn": []}  # fmt: skip
        assert usage["output_tokens_details"] == {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                                  "output_tokens_per_turn": [],
                                                  "tool_output_tokens_per_turn": []}  # fmt: skip
        sent = {"input": "hi", "max_output_tokens": 2, "metadata": {"k": "v"},
                "text": {"format": {"type": "text"}}}  # fmt: skip
        response = (await client.post("/v1/responses", json=sent)).json()
        assert response["metadata"] == {"k": "v"}
        assert response["text"] == {"format": {"type": "text"}}


async def test_stored_responses_are_retrieved_and_chained(make_client: ClientFactory) -> None:
    async with make_client() as client:
        first = (
            await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 8})
        ).json()
        assert (await client.get(f"/v1/responses/{first['id']}")).json() == first
        said = first["output"][0]["content"][0]["text"]
        body = {"input": "more", "previous_response_id": first["id"], "max_output_tokens": 8}
        second = (await client.post("/v1/responses", json=body)).json()
        prompt = serving_of(client).tokenizer.chat_prompt(
            [("user", "hi"), ("assistant", said), ("user", "more")]
        )
        assert second["usage"]["input_tokens"] == len(prompt)
        assert second["previous_response_id"] == first["id"]
        unstored = {"input": "hi", "max_output_tokens": 2, "store": False}
        gone = (await client.post("/v1/responses", json=unstored)).json()
        r = await client.get(f"/v1/responses/{gone['id']}")
        assert r.status_code == 404 and r.headers["x-slotserve-error-code"] == "response_not_found"
        r = await client.post("/v1/responses", json={"input": "x", "previous_response_id": "no"})
        assert r.status_code == 404 and field_of(r) == "previous_response_id"


async def test_responses_bad_input_is_a_400_naming_the_field(make_client: ClientFactory) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", "code_interpreter"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", "item"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]},
         "input.0.call_id", "c9"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0", ""),
        ({"background": True, "store": False}, "background", "stored"),
        ({"max_output_tokens": -1}, "max_output_tokens", ""),
    ]  # fmt: skip
    async with make_client() as client:
        for extra, param, word in cases:
            r = await client.post("/v1/responses", json={"input": "hi"} | extra)
            error = r.json()["error"]
            assert r.status_code == 400, (extra, r.text)
            assert str(field_of(r)).startswith(param), (extra, error)
            assert word in error["message"], (extra, error)
        call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
        answer = {"type": "function_call_output", "call_id": "c1", "output": "42"}
        r = await client.post(
            "/v1/responses", json={"input": [call, answer], "max_output_tokens": 2}
        )
        assert r.status_code == 200


async def test_a_background_response_is_cancelled_and_its_slot_freed(
    make_client: ClientFactory,
) -> None:
    async with make_client(num_slots=1, mock_step_ms=5, mock_stop_probability=0) as client:
        body = {"input": "hi", "max_output_tokens": 5000, "background": True}
        queued = (await client.post("/v1/responses", json=body)).json()
        assert queued["status"] == "queued" and queued["background"] is True
        cancelled = (await client.post(f"/v1/responses/{queued['id']}/cancel")).json()
        assert cancelled["status"] == "cancelled"
        assert serving_of(client).engine.core.live.get(queued["id"]) is None  # the slot is free
        again = await client.post(f"/v1/responses/{queued['id']}/cancel")
        assert again.json()["status"] == "cancelled"
        assert (await client.get(f"/v1/responses/{queued['id']}")).json()["status"] == "cancelled"
        done = (
            await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        ).json()
        r = await client.post(f"/v1/responses/{done['id']}/cancel")
        assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]
        r = await client.post("/v1/responses/nope/cancel")
        assert r.status_code == 404


def test_the_store_is_bounded_in_count_and_age_and_keeps_running_ones() -> None:
    now = [0.0]
    store = ResponseStore(size=2, max_age=10.0, clock=lambda: now[0])

    def entry(name: str, finished: bool = True) -> Stored:
        stored = Stored(name, {"status": "completed" if finished else "in_progress"}, [], set())
        if finished:
            store.finished(stored)
        store.put(stored)
        return stored

    entry("running", finished=False)
    entry("a")
    entry("b")
    assert store.get("running") is not None and store.get("a") is None
    assert store.get("b") is not None
    now[0] = 10.5
    assert store.get("b") is None and store.get("running") is not None
    assert len(ResponseStore(size=0, max_age=1.0)) == 0


async def test_a_bug_on_messages_is_a_500_in_anthropics_shape() -> None:
    async def failing_app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("a bug")

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}
    await AnthropicErrors(failing_app)(scope, None, send)  # type: ignore[arg-type]
    assert sent[0]["status"] == 500
    assert json.loads(sent[1]["body"]) == {
        "type": "error",
        "error": {"type": "api_error", "message": "internal server error"},
    }
    with pytest.raises(RuntimeError):  # elsewhere, Starlette's own handler answers it
        await AnthropicErrors(failing_app)(scope | {"path": "/v1/chat/completions"}, None, send)  # type: ignore[arg-type]


async def test_priority_and_user_reach_the_policies_as_on_chat(make_client: ClientFactory) -> None:
    async with make_client(num_slots=1, mock_step_ms=5, mock_stop_probability=0) as client:
        message = {"max_tokens": 2, "messages": USER, "priority": 5}
        r = await client.post("/v1/messages", json=message)
        assert r.headers["x-slotserve-priority-ignored"] == "1"
        response = {"input": "hi", "max_output_tokens": 2, "priority": 5}
        r = await client.post("/v1/responses", json=response)
        assert r.headers["x-slotserve-priority-ignored"] == "1"
        body = {"input": "hi", "max_output_tokens": 5000, "background": True, "user": "bob"}
        queued = (await client.post("/v1/responses", json=body)).json()
        live = serving_of(client).engine.core.live[queued["id"]]
        assert live.seq.user == "bob"
        await client.post(f"/v1/responses/{queued['id']}/cancel")


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def test_text_format_json_schema_constrains_a_response(make_client: ClientFactory) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    body = {"input": "A person", "max_output_tokens": 300, "text": {"format": fmt}}
    async with make_client() as client:
        whole = (await client.post("/v1/responses", json=body)).json()
        assert whole["status"] == "completed" and whole["text"]["format"] == fmt
        person = json.loads(whole["output"][0]["content"][0]["text"])
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)
        events = response_events(await client.post("/v1/responses", json=body | {"stream": True}))
        deltas = [e.data["delta"] for e in events if e.event == "response.output_text.delta"]
        assert json.loads("".join(deltas)) == person
        as_object = body | {"text": {"format": {"type": "json_object"}}}
        r = (await client.post("/v1/responses", json=as_object)).json()
        assert isinstance(json.loads(r["output"][0]["content"][0]["text"]), dict)
        bad = body | {"text": {"format": {"type": "json_schema", "name": "p",
                                          "schema": {"type": "nonsense"}}}}  # fmt: skip
        r = await client.post("/v1/responses", json=bad)
        assert r.status_code == 400 and field_of(r) == "text.format.schema"
        r = await client.post("/v1/responses", json=body | {"text": {"format": {"type": "yaml"}}})
        assert r.status_code == 400 and field_of(r) == "text.format.type"


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ANTHROPIC_TOOLS = [{"name": "weather", "input_schema": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", "name": "weather", "parameters": WEATHER}]


async def test_a_forced_tool_call_streams_as_each_protocols_tool_events(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        body = {"max_tokens": 300, "messages": USER, "tools": ANTHROPIC_TOOLS,
                "tool_choice": {"type": "tool", "name": "weather"}}  # fmt: skip
        whole = (await client.post("/v1/messages", json=body)).json()
        (use,) = whole["content"]
        assert use["type"] == "tool_use" and whole["stop_reason"] == "tool_use"
        events = parse_sse((await client.post("/v1/messages", json=body | {"stream": True})).text)
        names = [e.event for e in events]
        assert names[:2] == ANTHROPIC_EVENTS
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert events[1].data["content_block"]["type"] == "tool_use"
        pieces = [e.data["delta"] for e in events[2:-3]]
        assert {p["type"] for p in pieces} == {"input_json_delta"}
        assert json.loads("".join(p["partial_json"] for p in pieces)) == use["input"]
        assert events[-2].data["delta"]["stop_reason"] == "tool_use"

        body = {"max_output_tokens": 300, "input": "Weather?", "tools": RESPONSES_TOOLS,
                "tool_choice": "required"}  # fmt: skip
        whole = (await client.post("/v1/responses", json=body)).json()
        (call,) = whole["output"]
        assert call["type"] == "function_call" and whole["status"] == "completed"
        events = response_events(await client.post("/v1/responses", json=body | {"stream": True}))
        names = [e.event for e in events]
        assert names[:3] == ["response.created", "response.in_progress",
                             "response.output_item.added"]  # fmt: skip
        assert names[-3:] == ["response.function_call_arguments.done",
                              "response.output_item.done", "response.completed"]  # fmt: skip
        done = events[-3].data
        deltas = [e.data["delta"] for e in events if e.event.endswith("arguments.delta")]
        assert "".join(deltas) == done["arguments"] and json.loads(done["arguments"])["city"]
        final = events[-1].data["response"]
        assert final["output"][0]["call_id"] == events[2].data["item"]["call_id"]


@pytest.mark.parametrize("fallback", ["none", "describe"])
async def test_a_template_without_tools_is_told_of_them_only_with_describe(
    fallback: str,
) -> None:
    """As vLLM, a chat template that cannot render tools (the mock's) gets the turns as they
    are; ``--tool-prompt-fallback describe`` offers the tools in a system message."""
    tool = {"type": "function", "function": {"name": "weather", "parameters": WEATHER}}
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turns = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    async with app_client(tool_prompt_fallback=fallback) as client:
        body = {"messages": turns, "max_tokens": 1, "tools": [tool], "tool_choice": "none"}
        with_tools = await client.post("/v1/chat/completions", json=body | {"tool_choice": "auto"})
        without = await client.post("/v1/chat/completions", json=body)
        plain = serving_of(client).tokenizer.chat_prompt(
            [("user", USER[0]["content"]), ("assistant", ""), ("tool", "sunny")]
        )
        tokens = with_tools.json()["usage"]["prompt_tokens"]
        if fallback == "none":
            assert tokens == without.json()["usage"]["prompt_tokens"] == len(plain)
        else:
            assert tokens > without.json()["usage"]["prompt_tokens"] > len(plain)


async def test_tool_bad_input_is_a_400_naming_the_field(make_client: ClientFactory) -> None:
    messages: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "weather"}]}, "tools.0.input_schema"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "x"}},
         "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [{"name": "bad name!", "input_schema": WEATHER}]}, "tools.0.name"),
    ]  # fmt: skip
    responses: list[tuple[dict[str, Any], str]] = [
        ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "x"}},
         "tool_choice.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        ({"tools": RESPONSES_TOOLS, "tool_choice": "required",
          "text": {"format": {"type": "json_object"}}}, "text.format"),
    ]  # fmt: skip
    async with make_client() as client:
        for extra, param in messages:
            body = {"max_tokens": 5, "messages": USER} | extra
            r = await client.post("/v1/messages", json=body)
            message = anthropic_error(r, 400, "invalid_request_error")
            assert param.split(".")[0] in message or param in message, (extra, message)
        for extra, param in responses:
            r = await client.post("/v1/responses", json={"input": "hi"} | extra)
            assert r.status_code == 400, (extra, r.text)
            assert field_of(r) == param, (extra, r.json())


async def test_output_text_logprobs_when_included(make_client: ClientFactory) -> None:
    body = {"input": "hi", "max_output_tokens": 8, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}  # fmt: skip
    async with make_client() as client:
        whole = (await client.post("/v1/responses", json=body)).json()
        part = whole["output"][0]["content"][0]
        assert whole["top_logprobs"] == 2  # echoed, as vLLM (null when not asked)
        assert len(part["logprobs"]) == whole["usage"]["output_tokens"] == 8
        assert "".join(entry["token"] for entry in part["logprobs"]) == part["text"]
        assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])
        events = response_events(await client.post("/v1/responses", json=body | {"stream": True}))
        streamed = [x for e in events if e.event == "response.output_text.delta"
                    for x in e.data["logprobs"]]  # fmt: skip
        assert streamed == part["logprobs"] == events[-4].data["logprobs"]
        plain = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        assert plain.json()["output"][0]["content"][0]["logprobs"] is None  # as vLLM


async def test_a_mock_that_calls_tools_under_auto_still_follows_a_text_format(
    make_client: ClientFactory,
) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON}
    body = {"input": "A person", "max_output_tokens": 300, "text": {"format": fmt},
            "tools": RESPONSES_TOOLS}  # fmt: skip
    async with make_client(mock_tool_call_probability=1.0) as client:
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text  # not a 400 for a choice the client did not force
        assert set(json.loads(r.json()["output"][0]["content"][0]["text"])) == {"name", "age"}
        called = (await client.post("/v1/responses", json=body | {"text": None})).json()
        assert [item["type"] for item in called["output"]] == ["function_call"]


async def test_background_responses_are_bounded_by_the_store_size(
    make_client: ClientFactory,
) -> None:
    settings = {"num_slots": 1, "mock_step_ms": 5, "mock_stop_probability": 0,
                "responses_store_size": 2}  # fmt: skip
    async with make_client(**settings) as client:
        body = {"input": "hi", "max_output_tokens": 5000, "background": True}
        ids = [(await client.post("/v1/responses", json=body)).json()["id"] for _ in range(2)]
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.headers["x-slotserve-error-code"] == "too_many_background_responses"
        for response_id in ids:
            await client.post(f"/v1/responses/{response_id}/cancel")
        assert (await client.post("/v1/responses", json=body)).status_code == 200


async def test_chaining_from_a_failed_response_is_a_400(make_client: ClientFactory) -> None:
    async with make_client(allow_fault_headers=True) as client:
        body = {"max_output_tokens": 50, "input": "hi", "stream": True}
        r = await client.post("/v1/responses", json=body, headers={"x-slotserve-fail-after": "2"})
        failed = parse_sse(r.text)[-1].data["response"]
        chained = {"input": "and?", "previous_response_id": failed["id"]}
        r = await client.post("/v1/responses", json=chained)
        assert (
            r.status_code == 400
            and r.headers["x-slotserve-error-code"] == "previous_response_failed"
        )


def test_an_abort_is_reported_in_each_protocols_own_vocabulary() -> None:
    from app.api import generation
    from app.api.adapters import anthropic

    aborted = generation.Outcome("partial", "abort", None, 3, 2)
    assert anthropic.stop_reason(aborted) == "end_turn"
    assert anthropic.message_object("m", "x", aborted)["stop_reason"] == "end_turn"
