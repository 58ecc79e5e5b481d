"""The official clients against a real server: ``openai`` (Responses API), ``anthropic``
(Messages API) and ``openai-agents`` (an agent run to its final output)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pydantic
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from anthropic.types import MessageParam
from server_process import ServerProcess, running_server, wait_until

MODEL = "slotserve-mock"
KEY = "sk-alice"
ASK: list[MessageParam] = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--api-key", f"alice:{KEY}") as server:
        yield server


@pytest.fixture(scope="module")
def one_slow_slot() -> Iterator[ServerProcess]:
    """One slot, 10 ms steps, replies that never end on their own: a request runs until it is
    cancelled (or reaches its max tokens)."""
    flags = ("--num-slots", "1", "--mock-step-ms", "10", "--mock-stop-probability", "0")
    with running_server(*flags) as server:
        yield server


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def anthropic_client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_openai_responses_create_stream_retrieve_and_chain(server: ServerProcess) -> None:
    client = openai_client(server)
    created = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2000)
    assert created.status == "completed" and created.output_text
    assert created.usage is not None and created.usage.output_tokens > 0
    with client.responses.stream(model=MODEL, input="Hello", max_output_tokens=2000) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == created.output_text
    assert client.responses.retrieve(created.id).output_text == created.output_text
    chained = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=created.id, max_output_tokens=5
    )
    assert chained.usage is not None and created.usage.input_tokens < chained.usage.input_tokens
    scored = client.responses.create(
        model=MODEL, input="Hello", max_output_tokens=5, top_logprobs=1,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    message = scored.output[0]
    assert message.type == "message"
    (part,) = message.content
    assert part.type == "output_text" and len(part.logprobs or []) == 5
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp-unknown")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert "web_search" in str(bad.value)


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_openai_responses_parse_a_json_schema_text_format(server: ServerProcess) -> None:
    client = openai_client(server)
    parsed = client.responses.parse(
        model=MODEL, input="A person", text_format=Person, max_output_tokens=300
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    with client.responses.stream(
        model=MODEL, input="A person", text_format=Person, max_output_tokens=300
    ) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Person)


def test_openai_cancel_of_a_background_response(one_slow_slot: ServerProcess) -> None:
    client = openai_client(one_slow_slot)
    queued = client.responses.create(
        model=MODEL, input="Hello", max_output_tokens=5000, background=True
    )
    assert queued.status == "queued"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    # the one slot is free: a short request runs at once
    short = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, timeout=5)
    assert short.status == "incomplete" and short.usage is not None
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(short.id)


def test_anthropic_messages_create_stream_and_count_tokens(server: ServerProcess) -> None:
    client = anthropic_client(server)
    message = client.messages.create(
        model=MODEL,
        max_tokens=2000,
        system="Be brief",
        messages=ASK,
    )
    assert message.stop_reason == "end_turn"
    text = message.content[0].text  # type: ignore[union-attr]
    with client.messages.stream(
        model=MODEL,
        max_tokens=2000,
        system="Be brief",
        messages=ASK,
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == message.usage.output_tokens
    counted = client.messages.count_tokens(
        model=MODEL,
        system="Be brief",
        messages=ASK,
    )
    assert counted.input_tokens == message.usage.input_tokens
    limited = client.messages.create(
        model=MODEL,
        max_tokens=3,
        messages=ASK,
        stop_sequences=["zzz"],
    )
    assert limited.stop_reason == "max_tokens" and limited.usage.output_tokens == 3


def test_anthropic_errors_reach_the_client_in_anthropics_shape(server: ServerProcess) -> None:
    client = anthropic_client(server)
    orphan: list[MessageParam] = [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}
    ]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=5, messages=orphan)
    body = bad.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "t9" in body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, max_tokens=5, messages=ASK)


async def test_openai_agents_runs_an_agent_to_its_final_output(server: ServerProcess) -> None:
    set_tracing_disabled(True)  # no trace export: no network
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = Agent(name="storyteller", instructions="Be brief", model=model,
                  model_settings=ModelSettings(max_tokens=2000))  # fmt: skip
    result = await Runner.run(agent, "Tell me a story")
    assert isinstance(result.final_output, str) and result.final_output


def test_closing_a_stream_frees_its_slot_on_both_routes(one_slow_slot: ServerProcess) -> None:
    bodies = {
        "/v1/messages": {"max_tokens": 5000, "messages": ASK, "stream": True},
        "/v1/responses": {"max_output_tokens": 5000, "input": "Hi", "stream": True},
    }
    with httpx.Client(base_url=one_slow_slot.url, timeout=10) as http:
        for path, body in bodies.items():
            with http.stream("POST", path, json=body) as stream:
                lines = stream.iter_lines()
                assert any("delta" in line for line in lines)  # generating: the slot is held
            short = dict(body, stream=False, max_tokens=2, max_output_tokens=2)
            # 5000 steps of 10 ms would be 50 s: the slot must have been freed
            assert http.post(path, json=short, timeout=5).status_code == 200


@pytest.mark.real_model
def test_hf_smollm2_answers_through_messages_responses_and_an_agent() -> None:
    from hf_smollm2 import smollm2_cache_dir
    from server_process import loading_server

    flags = ["--model", "smollm2", "--model-cache-dir", str(smollm2_cache_dir())]
    with loading_server(*flags, "--num-slots", "2", "--max-model-len", "512") as (server, seen):
        assert seen[-1] == "ok"
        name, question = "SmolLM2-135M-Instruct", "What is the capital of France?"
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        ask: list[MessageParam] = [{"role": "user", "content": question}]
        # this SDK version has no temperature argument: greedy via the body
        message = claude.messages.create(
            model=name, max_tokens=60, messages=ask, extra_body={"temperature": 0}
        )
        assert message.stop_reason == "end_turn"
        assert "Paris" in message.content[0].text  # type: ignore[union-attr]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        response = client.responses.create(
            model=name, input=question, max_output_tokens=60, temperature=0
        )
        assert response.status == "completed" and "Paris" in response.output_text
        set_tracing_disabled(True)
        async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        agent = Agent(name="geographer", model=OpenAIResponsesModel(name, async_client),
                      model_settings=ModelSettings(temperature=0, max_tokens=60))  # fmt: skip
        assert "Paris" in Runner.run_sync(agent, question).final_output
        asked: list[str] = []

        @function_tool
        def weather(city: str) -> str:
            """The weather in a city."""
            asked.append(city)
            return f"It is sunny in {city}."

        forecaster = Agent(
            name="forecaster", instructions="Use the weather tool.", tools=[weather],
            model=OpenAIResponsesModel(name, async_client), tool_use_behavior="stop_on_first_tool",
            # one call (in parallel, greedy SmolLM2 repeats the call until max_tokens)
            model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                         temperature=0, max_tokens=100),
        )  # fmt: skip
        result = Runner.run_sync(forecaster, "What is the weather in Paris?")
        assert asked == ["Paris"] and result.final_output == "It is sunny in Paris."


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_openai_responses_function_tool_round_trip(server: ServerProcess) -> None:
    client = openai_client(server)
    tools: list[Any] = [{"type": "function", "name": "weather", "parameters": WEATHER_SCHEMA,
                         "strict": True, "description": "The weather in a city"}]  # fmt: skip
    first = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=tools, tool_choice="required",
        max_output_tokens=300,
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "weather" and set(json.loads(call.arguments)) == {"city"}
    answer = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=tools, max_output_tokens=2000,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert answer.status == "completed" and answer.output_text
    assert [item.type for item in answer.output] == ["message"]
    with client.responses.stream(
        model=MODEL, input="Weather?", tools=tools, max_output_tokens=300,
        tool_choice={"type": "function", "name": "weather"},
    ) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.arguments == "".join(deltas)
    json.loads(streamed.arguments)


def test_anthropic_tool_round_trip_streamed_and_not(server: ServerProcess) -> None:
    client = anthropic_client(server)
    tools: list[Any] = [{"name": "weather", "description": "The weather in a city",
                         "input_schema": WEATHER_SCHEMA}]  # fmt: skip
    ask: list[MessageParam] = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(
        model=MODEL, max_tokens=300, messages=ask, tools=tools, tool_choice={"type": "any"}
    )
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "weather" and set(use.input) == {"city"}
    history: list[MessageParam] = [
        *ask,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]  # fmt: skip
    answer = client.messages.create(model=MODEL, max_tokens=2000, messages=history, tools=tools)
    assert answer.stop_reason == "end_turn" and answer.content[0].type == "text"
    with client.messages.stream(
        model=MODEL, max_tokens=300, messages=ask, tools=tools,
        tool_choice={"type": "tool", "name": "weather"},
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (streamed,) = final.content
    assert streamed.type == "tool_use" and set(streamed.input) == {"city"}


async def test_openai_agents_runs_an_agent_with_a_function_tool(server: ServerProcess) -> None:
    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    agent = Agent(
        name="forecaster", instructions="Answer with the weather tool.", tools=[weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        # the first turn must call the tool; the SDK then resets the choice to auto, and the
        # mock (--mock-tool-call-probability 0) answers in text: the final output
        model_settings=ModelSettings(tool_choice="required", max_tokens=2000),
    )  # fmt: skip
    result = await Runner.run(agent, "Weather in Paris?")
    assert len(asked) == 1
    assert isinstance(result.final_output, str) and result.final_output


def test_a_stored_stream_is_visible_while_it_runs_and_cancelled_if_its_client_leaves(
    one_slow_slot: ServerProcess,
) -> None:
    body = {"max_output_tokens": 5000, "input": "Hi", "stream": True}
    with httpx.Client(base_url=one_slow_slot.url, timeout=10) as http:
        with http.stream("POST", "/v1/responses", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            response_id = json.loads(first[5:])["response"]["id"]
            running = http.get(f"/v1/responses/{response_id}").json()
            assert running["status"] == "in_progress"

        def status() -> str | None:
            found = http.get(f"/v1/responses/{response_id}").json()["status"]
            return str(found) if found != "in_progress" else None

        assert wait_until(status, 10, "the abandoned stream to be stored") == "cancelled"
