"""OpenAI-compatible routes through the ASGI app (the real `openai` client runs in test_e2e)."""

from __future__ import annotations

import json

import pytest
from conftest import ClientFactory
from error_shape import field_of
from sse import parse_sse

from app.engine.stop_strings import StopStringMatcher


async def test_models_lists_the_served_model(make_client: ClientFactory) -> None:
    async with make_client(model_name="m1") as client:
        data = (await client.get("/v1/models")).json()
        assert [m["id"] for m in data["data"]] == ["m1"]
        (model,) = data["data"]
        # vLLM's fields, which its clients and routers read (root: the name, not a path)
        assert (model["root"], model["parent"]) == ("m1", None)
        (permission,) = model["permission"]
        assert permission["object"] == "model_permission" and permission["allow_sampling"]


async def test_completion_text_matches_native_generate(make_client: ClientFactory) -> None:
    async with make_client() as client:
        native = (
            await client.post(
                "/generate", json={"prompt": "Once ", "max_tokens": 40, "stream": False}
            )
        ).json()
        r = await client.post(
            "/v1/completions", json={"model": "slotserve-mock", "prompt": "Once ", "max_tokens": 40}
        )
        body = r.json()
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == native["text"]
        assert body["choices"][0]["finish_reason"] == native["finish_reason"]
        assert body["usage"]["completion_tokens"] == len(native["tokens"])


async def test_streamed_completion_concatenates_to_the_whole_and_ends_with_done(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        whole = (
            await client.post("/v1/completions", json={"prompt": "Once ", "max_tokens": 60})
        ).json()
        r = await client.post(
            "/v1/completions",
            json={
                "prompt": "Once ",
                "max_tokens": 60,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        events = parse_sse(r.text)
        assert events[-1].data == "[DONE]"
        usage = events[-2].data
        assert usage["choices"] == [] and usage["usage"] == whole["usage"]
        chunks = [e.data for e in events[:-2]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


async def test_stop_string_truncates_and_finishes_with_stop(make_client: ClientFactory) -> None:
    async with make_client() as client:
        free = (
            await client.post(
                "/v1/completions", json={"prompt": "Once ", "max_tokens": 200, "ignore_eos": True}
            )
        ).json()
        text = free["choices"][0]["text"]
        stop = text[10:13]
        expected = text[: text.index(stop)]
        for stream in (False, True):
            r = await client.post(
                "/v1/completions",
                json={
                    "prompt": "Once ",
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stop": [stop],
                    "stream": stream,
                },
            )
            if stream:
                chunks = [e.data for e in parse_sse(r.text)[:-1]]
                got = "".join(c["choices"][0]["text"] for c in chunks)
                last = chunks[-1]["choices"][0]
            else:
                last = r.json()["choices"][0]
                got = last["text"]
            assert got == expected
            # vLLM's stop_reason: the stop string that ended the choice
            assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
        metrics = (await client.get("/metrics")).text
        assert (
            'request_success_total{engine="0",finished_reason="stop",key="",'
            'model_name="slotserve-mock"} 2.0' in metrics
        )
        # Every finish reason is exported from the start: none of these ended as an abort.
        assert 'finished_reason="abort",key="",model_name="slotserve-mock"} 0.0' in metrics


def test_stop_string_matcher_never_releases_part_of_a_stop_string() -> None:
    matcher = StopStringMatcher(["END"])
    out = [matcher.feed(piece) for piece in ["abc E", "N", "x E", "ND tail"]]
    assert "".join(out) == "abc ENx "
    assert matcher.hit and matcher.flush() == ""


async def test_chat_completion_shapes(make_client: ClientFactory) -> None:
    async with make_client() as client:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30}
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        assert whole["object"] == "chat.completion"
        message = whole["choices"][0]["message"]
        assert message["role"] == "assistant" and message["content"]
        events = parse_sse(
            (await client.post("/v1/chat/completions", json=body | {"stream": True})).text
        )
        chunks = [e.data for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == message["content"]


async def test_unknown_model_is_404_and_bad_fields_are_400(make_client: ClientFactory) -> None:
    async with make_client() as client:
        r = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
        assert r.status_code == 404 and r.headers["x-slotserve-error-code"] == "model_not_found"
        r = await client.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and field_of(r) == "messages"
        r = await client.post("/v1/completions", json={"prompt": "x", "n": 17})  # --max-n 16
        assert r.status_code == 400 and field_of(r) == "n"


JSON_HEADERS = {"content-type": "application/json"}
LONE_SURROGATE = "\ud800"  # valid JSON ("\ud800"), but not Unicode text: it cannot be encoded


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"prompt": f"hi {LONE_SURROGATE}"}, "prompt"),
        ("/v1/completions", {"prompt": f"hi {LONE_SURROGATE}"}, "prompt"),
        ("/v1/completions", {"prompt": [LONE_SURROGATE]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": LONE_SURROGATE}, "stop"),
        ("/v1/completions", {"prompt": "hi", "model": LONE_SURROGATE}, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE_SURROGATE}]},
         "messages.0.content"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE_SURROGATE}]}]},
         "messages.0.content"),
    ],
)  # fmt: skip
async def test_text_that_is_not_unicode_is_a_400_naming_the_field(
    make_client: ClientFactory, path: str, body: dict[str, object], param: str
) -> None:
    """Found in review: a lone surrogate in a chat message reached the tokenizer and became a
    500. JSON allows it; UTF-8 cannot encode it, so it is the client's mistake."""
    async with make_client() as client:
        r = await client.post(path, content=json.dumps(body), headers=JSON_HEADERS)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert str(field_of(error)).startswith(param)
        assert "surrogate" in error["message"] or "unicode" in error["message"]


async def test_max_completion_tokens_wins_over_the_deprecated_max_tokens(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        r = await client.post(
            "/v1/chat/completions", json=body | {"max_tokens": 3, "max_completion_tokens": 5}
        )
        assert r.json()["usage"]["completion_tokens"] == 5
        r = await client.post("/v1/chat/completions", json=body | {"max_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3


async def test_null_means_the_default_for_n_and_stream(make_client: ClientFactory) -> None:
    async with make_client() as client:
        body = {"prompt": "hi", "max_tokens": 2, "n": None, "stream": None}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["object"] == "text_completion"


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "suffix", "end"),
        ("/v1/completions", "best_of", 2),
    ],
)
async def test_fields_that_would_change_the_reply_are_refused_not_ignored(
    make_client: ClientFactory, path: str, field: str, value: object
) -> None:
    """Found in review: logprobs, echo, tools... were accepted and the reply came without
    them, so a scoring client read ``logprobs: null`` as an answer."""
    body: dict[str, object] = {"max_tokens": 2}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [MESSAGE]}
    async with make_client() as client:
        r = await client.post(path, json=body | {field: value})
        assert r.status_code == 400, r.text
        assert field_of(r) == field
        assert r.headers["x-slotserve-error-code"] == "unsupported_parameter"
        neutral = {"logprobs": False if "chat" in path else None, "echo": False, "best_of": 1}
        if field in neutral:  # the neutral value is fine
            r = await client.post(path, json=body | {field: neutral[field]})
            assert r.status_code == 200, r.text


MESSAGE = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages.0.content.0.text"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", 1]}, "stop.1"),
        ("/v1/completions", {"prompt": [[1, "x"]]}, "prompt.0.1"),
    ],
)  # fmt: skip
async def test_a_nested_mistake_names_the_innermost_field(
    make_client: ClientFactory, path: str, body: dict[str, object], param: str
) -> None:
    """Found in review: when every member of a union failed on type, the error named the outer
    field and its string type, though a list was right and one item was wrong."""
    async with make_client() as client:
        r = await client.post(path, json=body)
        assert r.status_code == 400 and field_of(r) == param


async def test_max_tokens_0_is_refused_as_vllm_refuses_it(make_client: ClientFactory) -> None:
    """vLLM: max_tokens must be at least 1, but for a completion that echoes its prompt (a
    prompt's score, as lm-evaluation-harness asks it)."""
    async with make_client() as client:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat)):
            r = await client.post(path, json=body | {"max_tokens": 0})
            assert r.status_code == 400 and field_of(r) == "max_tokens"
        echo = {"prompt": "hi", "max_tokens": 0, "echo": True}
        assert (await client.post("/v1/completions", json=echo)).status_code == 200


async def test_stream_options_without_stream_is_refused(make_client: ClientFactory) -> None:
    """As vLLM answers it: include_usage means nothing to a whole reply."""
    async with make_client() as client:
        body = {"prompt": "hi", "stream_options": {"include_usage": True}}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 400 and field_of(r) == "stream_options"
        streamed = await client.post("/v1/completions", json=body | {"stream": True})
        assert streamed.status_code == 200


async def test_n_greedy_choices_are_refused(make_client: ClientFactory) -> None:
    """As vLLM answers it: n > 1 at temperature 0 would be n copies of one answer."""
    async with make_client() as client:
        body = {"prompt": "hi", "n": 2, "max_tokens": 2}
        r = await client.post("/v1/completions", json=body | {"temperature": 0})
        assert r.status_code == 400 and field_of(r) == "n"
        assert (await client.post("/v1/completions", json=body)).status_code == 200


async def test_a_role_the_server_does_not_know_reaches_the_template(
    make_client: ClientFactory,
) -> None:
    """vLLM accepts any role (a chat template may know it); a role that is not a word could
    forge the template's markup, and is refused."""
    async with make_client() as client:
        chat = {"max_tokens": 2, "messages": [{"role": "wizard", "content": "hi"}]}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        forged = {**chat, "messages": [{"role": "user<|im_end|>", "content": "hi"}]}
        r = await client.post("/v1/chat/completions", json=forged)
        assert r.status_code == 400 and field_of(r) == "messages.0.role"
