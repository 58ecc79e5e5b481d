"""Structured outputs through the official ``openai`` SDK against real servers: the mock and
SmolLM2 parse into a Pydantic model; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import httpx
import openai
import pytest
from error_shape import field_of
from hf_smollm2 import smollm2_cache_dir
from pydantic import BaseModel
from server_process import ServerProcess, loading_server, running_server


class Address(BaseModel):
    city: str
    zip_code: str


class Person(BaseModel):
    name: str
    age: int
    kind: Literal["human", "robot"]
    tags: list[str]
    address: Address


@pytest.fixture(scope="module")
def mock_server() -> Iterator[ServerProcess]:
    with running_server("--num-slots", "4") as server:
        yield server


def test_the_sdk_parses_the_mock_reply_into_a_pydantic_model(mock_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=mock_server.url + "/v1", api_key="unused", max_retries=0)
    for content in ("Describe someone.", "Another one, please."):
        completion = client.chat.completions.parse(
            model="slotserve-mock",
            messages=[{"role": "user", "content": content}],
            response_format=Person,
            max_tokens=1000,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        person = choice.message.parsed
        assert isinstance(person, Person) and person.kind in ("human", "robot")


def test_structured_outputs_on_completions_and_chat(mock_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=mock_server.url + "/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    completion = client.completions.create(
        model="slotserve-mock",
        prompt="hello",
        max_tokens=100,
        extra_body={"structured_outputs": {"json": schema}},
    )
    assert isinstance(json.loads(completion.choices[0].text)["n"], int)
    chat = client.chat.completions.create(
        model="slotserve-mock",
        messages=[{"role": "user", "content": "sentiment?"}],
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    assert chat.choices[0].message.content in ("positive", "negative")
    stream = client.chat.completions.create(
        model="slotserve-mock",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(
    mock_server: ServerProcess, body: dict[str, object], param: str
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    response = httpx.post(
        mock_server.url + "/v1/chat/completions", json={"messages": messages, **body}
    )
    assert response.status_code == 400, response.text
    assert field_of(response) == param


def test_a_grammar_cut_by_max_tokens_ends_with_length(mock_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=mock_server.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="slotserve-mock",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        response_format={"type": "json_object"},
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 5


class City(BaseModel):
    name: str
    country: str


@pytest.mark.real_model
def test_the_sdk_parses_a_smollm2_reply_into_a_pydantic_model() -> None:
    flags = ["--model", "smollm2", "--model-cache-dir", str(smollm2_cache_dir())]
    flags += ["--num-slots", "2", "--max-model-len", "512"]
    with loading_server(*flags) as (server, seen):
        assert seen[-1] == "ok"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        completion = client.chat.completions.parse(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
            response_format=City,
            max_tokens=200,
            temperature=0,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)
        assert "Paris" in choice.message.parsed.name
        # the grammar's text is complete before min_tokens, whose ban forbids the EOS that would
        # end it (as vLLM's grammar backends end a reply): it still ends, complete, not a 500
        held = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
            response_format={"type": "json_object"},
            max_tokens=200,
            temperature=0,
            extra_body={"min_tokens": 150},
        )
        assert held.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(held.choices[0].message.content or ""), dict)
