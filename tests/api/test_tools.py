"""Tool calling: the default format's parser, the stream deltas, the request checks (400s
naming the field), and round trips through the official ``openai`` SDK against a real server,
streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from error_shape import field_of
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from server_process import ServerProcess, running_server

from app.api.tool_reader import CallArguments, CallReader, CallStart, TextPiece
from app.api.tools import ToolPlan
from app.structured.tools import ToolChoice, ToolMode, ToolSpec, parse_calls

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Paris?"}]
MODEL = "slotserve-mock"
AUTO = ToolPlan([ToolSpec("f")], ToolChoice(ToolMode.AUTO), True)


def test_auto_reads_calls_in_the_default_format_and_keeps_the_rest_as_content() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = parse_calls(text, AUTO.choice)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    assert parse_calls("no call here", AUTO.choice) == ("no call here", [])
    broken = "<tool_call>{not json</tool_call>"
    assert parse_calls(broken, AUTO.choice) == (broken, [])
    assert parse_calls(text, AUTO.choice, frozenset({"g"})) == (text, [])  # f was not offered
    two = text + '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert len(parse_calls(two, AUTO.choice, frozenset({"f"}))[1]) == 2
    assert parse_calls(two, AUTO.choice, frozenset({"f"}), parallel=False) == (two, [])
    assert parse_calls(text, AUTO.choice, frozenset({"g"})) == (text, [])  # f was not offered
    two = text + '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert len(parse_calls(two, AUTO.choice, frozenset({"f"}))[1]) == 2
    assert parse_calls(two, AUTO.choice, frozenset({"f"}), parallel=False) == (two, [])


def test_auto_streams_content_and_holds_back_a_possible_call_start() -> None:
    reader = CallReader(AUTO)
    pieces = ["Hi <tool", "_c", 'all>{"name": "f", "argu', 'ments": {}}</tool_call>']
    out = [p for piece in pieces for p in reader.feed(piece, None)] + reader.feed("", "stop")
    assert out[0] == TextPiece("Hi ")
    starts = [p for p in out if isinstance(p, CallStart)]
    assert starts[0].call.name == "f" and starts[0].call.id.startswith("call_")
    assert "".join(p.text for p in out if isinstance(p, CallArguments)) == "{}"
    assert reader.calls == [starts[0].call] and reader.content == "Hi "
    plain = CallReader(AUTO)
    assert plain.feed("<to", None) == [] and plain.feed("day", "stop") == [TextPiece("<today")]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--num-slots", "4", "--mock-tool-call-probability", "0.5") as server:
        yield server


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_arguments(name: str, arguments: str) -> None:
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), tool["function"].get("parameters", {}))


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip_through_the_sdk(client: openai.OpenAI, stream: bool) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, stream=True
            )
        )
        parts = [c.choices[0] for c in chunks if c.choices]
        deltas = [d for p in parts for d in p.delta.tool_calls or []]
        assert deltas[0].index == 0 and deltas[0].id and deltas[0].function
        assert deltas[0].function.name == "get_weather"
        assert deltas[0].function.arguments is None  # the name first, alone (as vLLM)
        assert all(d.id is None and d.index == 0 for d in deltas[1:])
        arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
        call_id, finish = deltas[0].id, parts[-1].finish_reason
    else:
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named
        )
        choice = reply.choices[0]
        assert choice.message.tool_calls and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        arguments, call_id, finish = call.function.arguments, call.id, choice.finish_reason
    assert finish == "stop"  # a named function ends with "stop", as OpenAI's does
    _check_arguments("get_weather", arguments)
    assistant: Any = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }
    answer = client.chat.completions.create(
        model=MODEL,
        tools=TOOLS,
        stream=False,
        tool_choice="none",
        messages=[*ASK, assistant, {"role": "tool", "tool_call_id": call_id, "content": "sunny"}],
    )
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content


def test_required_calls_a_tool_with_arguments_that_match_its_schema(client: openai.OpenAI) -> None:
    for parallel in (True, False):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        calls = reply.choices[0].message.tool_calls or []
        assert reply.choices[0].finish_reason == "tool_calls" and calls
        assert parallel or len(calls) == 1
        for call in calls:
            assert call.type == "function"
            _check_arguments(call.function.name, call.function.arguments)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", stream=True
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function and deltas[0].function.name
    _check_arguments(
        deltas[0].function.name,
        "".join(d.function.arguments or "" for d in deltas if d.function and d.index == 0),
    )


def test_auto_calls_a_tool_with_the_mock_tool_call_probability(client: openai.OpenAI) -> None:
    reasons = [
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300)
        .choices[0]
        .finish_reason
        for _ in range(24)
    ]
    assert set(reasons) == {"stop", "tool_calls"}  # p = 0.5: both, with certainty 1 - 2^-23
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none"
    )
    assert none.choices[0].finish_reason == "stop" and not none.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
        (
            {"messages": [*ASK, {"role": "tool", "content": "x", "tool_call_id": "c1"}]},
            "messages.1.tool_call_id",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            "messages.0.tool_calls",
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": ASK} | extra
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    error = caught.value.body
    assert isinstance(error, dict) and field_of(error) == param, error


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_not_cut_by_stop_strings(client: openai.OpenAI, stream: bool) -> None:
    """Review finding: a stop string cut a named call's arguments (and streamed and whole
    replies disagreed); a forced call's JSON is never cut."""
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    args: Any = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, stop=['"'])
    if stream:
        chunks = list(client.chat.completions.create(**args, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**args).choices[0]
        calls = choice.message.tool_calls or []
        assert calls and calls[0].type == "function"
        arguments, finish = calls[0].function.arguments, choice.finish_reason
    assert finish == "stop"
    _check_arguments("get_weather", arguments)


def test_empty_parameters_mean_an_arguments_object(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "function": {"name": "ping", "parameters": {}}}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[tool], tool_choice="required"
    )
    calls = reply.choices[0].message.tool_calls or []
    assert calls and calls[0].type == "function"
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_auto_with_a_response_format_never_depends_on_the_mock_coin(
    client: openai.OpenAI,
) -> None:
    """Review finding: under auto, the mock's draw turned the request into a forced call that
    response_format cannot combine with: a random 400. With a format, the mock answers."""
    for _ in range(8):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, response_format={"type": "json_object"}
        )
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"guided_choice": ["a"]}, "guided_choice"),
        (
            {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        (
            {"structured_outputs": {"choice": [f"option {i}" for i in range(8000)]}},
            "structured_outputs.choice",
        ),
    ],
)
def test_structured_fields_that_cannot_be_honoured_are_a_400(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra)
    error = caught.value.body
    assert isinstance(error, dict) and field_of(error) == param, error
