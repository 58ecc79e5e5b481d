"""Sampling parameters and log probabilities over the OpenAI routes, with both mocks.

The mocks obey what forbids tokens (``min_tokens`` against stop tokens and stop strings,
``logit_bias`` bans, ``allowed_token_ids``, ``bad_words``) and report a synthetic distribution
in which the chosen token is the most likely (``app/models/mock_sampling.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import ClientFactory
from error_shape import field_of
from sse import parse_sse

from app.api.aligned_tokens import AlignedTokens
from app.engine.stop_strings import StopStringMatcher
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.protocol import Model

MESSAGE = {"role": "user", "content": "hi"}
LN2 = math.log(2)


def flat(lists: Any) -> list[Any]:
    return [item for part in lists for item in part]


def mocks() -> list[Model]:
    return [MockModel(), CachedMockModel(8)]


async def _completion(client: Any, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/completions", json={"prompt": "Tell me ", **body})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


@pytest.mark.parametrize("model", mocks(), ids=["mock", "cached-mock"])
async def test_bans_and_allow_lists_change_the_mock_text_and_nothing_else(
    make_client: ClientFactory, model: Model
) -> None:
    async with make_client(model, num_slots=8) as client:
        plain = (await _completion(client, max_tokens=40))["choices"][0]["text"]
        assert "e" in plain
        banned = await _completion(client, max_tokens=40, logit_bias={str(ord("e")): -100})
        assert "e" not in banned["choices"][0]["text"]
        mild = await _completion(client, max_tokens=40, logit_bias={str(ord("e")): -5})
        assert mild["choices"][0]["text"] == plain  # reshapes a distribution: no effect
        allowed = await _completion(client, max_tokens=6, allowed_token_ids=[65, 66])
        assert set(allowed["choices"][0]["text"]) <= {"A", "B"}
        penalties = await _completion(
            client, max_tokens=40, frequency_penalty=1.5, presence_penalty=-1,
            repetition_penalty=1.3, min_p=0.1,
        )  # fmt: skip
        assert penalties["choices"][0]["text"] == plain


@pytest.mark.parametrize("model", mocks(), ids=["mock", "cached-mock"])
async def test_min_tokens_holds_against_the_stop_token_and_stop_strings(
    make_client: ClientFactory, model: Model
) -> None:
    async with make_client(model, num_slots=8) as client:
        serving = client.serving  # type: ignore[attr-defined]
        serving.engine.model.language = type(serving.engine.model.language)(stop_probability=0.9)
        short = await _completion(client, max_tokens=200)
        assert (
            short["usage"]["completion_tokens"] < 30
            and short["choices"][0]["finish_reason"] == "stop"
        )
        held = await _completion(client, max_tokens=200, min_tokens=60)
        assert held["usage"]["completion_tokens"] >= 60
        stopped = await _completion(client, max_tokens=200, stop=[" "], min_tokens=12)
        choice = stopped["choices"][0]
        assert choice["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] >= 12
        assert " " not in choice["text"][-1:]


async def test_chat_logprobs_whole_and_streamed_agree(make_client: ClientFactory) -> None:
    body = {"messages": [MESSAGE], "max_tokens": 12, "logprobs": True, "top_logprobs": 3}
    async with make_client() as client:
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        content = whole["choices"][0]["logprobs"]["content"]
        assert "".join(c["token"] for c in content) == whole["choices"][0]["message"]["content"]
        for entry in content:
            assert entry["logprob"] == pytest.approx(-LN2)
            tops = entry["top_logprobs"]
            assert len(tops) == 3 and tops[0]["token"] == entry["token"]
            assert [t["logprob"] for t in tops] == sorted(
                (t["logprob"] for t in tops), reverse=True
            )
            assert entry["bytes"] == list(entry["token"].encode())
        r = await client.post("/v1/chat/completions", json=body | {"stream": True})
        chunks = [e.data for e in parse_sse(r.text)[:-1]]
        streamed = flat((c["choices"][0]["logprobs"] or {}).get("content", []) for c in chunks)
        assert streamed == content


async def test_completion_logprobs_shape_whole_and_streamed(make_client: ClientFactory) -> None:
    async with make_client() as client:
        whole = await _completion(client, max_tokens=10, logprobs=2)
        lp = whole["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == whole["choices"][0]["text"]
        assert lp["text_offset"] == [
            sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))
        ]
        for token, value, top in zip(
            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
        ):
            assert max(top, key=top.get) == token and top[token] == value
        r = await client.post(
            "/v1/completions",
            json={"prompt": "Tell me ", "max_tokens": 10, "logprobs": 2, "stream": True},
        )
        chunks = [e.data["choices"][0]["logprobs"] for e in parse_sse(r.text)[:-1]]
        assert flat(c["tokens"] for c in chunks) == lp["tokens"]
        assert flat(c["text_offset"] for c in chunks) == lp["text_offset"]


@pytest.mark.parametrize("model", mocks(), ids=["mock", "cached-mock"])
async def test_echo_with_max_tokens_0_scores_the_prompt(
    make_client: ClientFactory, model: Model
) -> None:
    """What lm-evaluation-harness sends for a loglikelihood request."""
    async with make_client(model, num_slots=8, max_num_batched_tokens=8) as client:  # chunked
        prompt = list(b"The quick brown fox jumps")
        body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
        result = await _completion(client, **body)
        choice = result["choices"][0]
        assert choice["text"] == "The quick brown fox jumps" and choice["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == 0
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None
        assert all(v is not None and v < 0 for v in lp["token_logprobs"][1:])
        prompt_lp = choice["prompt_logprobs"]
        assert prompt_lp[0] is None and len(prompt_lp) == len(prompt)
        for token, value, entry in zip(
            prompt[1:], lp["token_logprobs"][1:], prompt_lp[1:], strict=True
        ):
            assert entry[str(token)]["logprob"] == value
        again = await _completion(client, **body)
        assert again["choices"][0]["logprobs"] == lp  # deterministic
        streamed = await client.post(
            "/v1/completions", json={"prompt": prompt, **body, "stream": True}
        )
        chunks = [e.data["choices"][0] for e in parse_sse(streamed.text)[:-1]]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        assert flat(c["logprobs"]["token_logprobs"] for c in chunks) == lp["token_logprobs"]


async def test_chat_prompt_logprobs_next_to_the_choices(make_client: ClientFactory) -> None:
    async with make_client() as client:
        body = {"messages": [MESSAGE], "max_tokens": 3, "prompt_logprobs": 0}
        result = (await client.post("/v1/chat/completions", json=body)).json()
        assert result["prompt_logprobs"][0] is None
        assert len(result["prompt_logprobs"]) == result["usage"]["prompt_tokens"]
        assert result["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": 1.5}, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"logit_bias": {"257": -100}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"a": 1}}, "logit_bias.a"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),
        ("/v1/completions", {"allowed_token_ids": [300]}, "allowed_token_ids"),
        ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("/v1/completions", {"presence_penalty": -3}, "presence_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"min_p": 1.5}, "min_p"),
        ("/v1/completions", {"bad_words": [""]}, "bad_words.0"),
    ],
)
async def test_bad_sampling_input_is_a_400_naming_the_field(
    make_client: ClientFactory, path: str, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 4}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [MESSAGE]}
    async with make_client() as client:
        r = await client.post(path, json=body | extra)
        assert r.status_code == 400, r.text
        assert field_of(r) == param, r.text


async def test_bad_words_are_never_completed(make_client: ClientFactory) -> None:
    async with make_client() as client:
        plain = (await _completion(client, max_tokens=60))["choices"][0]["text"]
        word = next(w for w in plain.split() if len(w) > 2)
        result = await _completion(client, max_tokens=60, bad_words=[word])
        assert word not in result["choices"][0]["text"]


async def test_native_generate_takes_the_sampling_fields(make_client: ClientFactory) -> None:
    async with make_client() as client:
        body = {"prompt": "Tell me ", "max_tokens": 20, "stream": False,
                "logit_bias": {str(ord("e")): -100}, "min_tokens": 20}  # fmt: skip
        result = (await client.post("/generate", json=body)).json()
        assert len(result["tokens"]) == 20 and "e" not in result["text"]


async def test_logprobs_under_a_grammar_still_put_the_chosen_token_first(
    make_client: ClientFactory,
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"messages": [MESSAGE], "max_tokens": 40, "n": 2, "logprobs": True,
            "top_logprobs": 2, "response_format": json_schema}  # fmt: skip
    async with make_client() as client:
        result = (await client.post("/v1/chat/completions", json=body)).json()
    for choice in result["choices"]:
        content = choice["logprobs"]["content"]
        assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
        assert all(entry["top_logprobs"][0]["token"] == entry["token"] for entry in content)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"allowed_token_ids": [101], "logit_bias": {"101": -100}}, "allowed_token_ids"),
        ({"allowed_token_ids": [101], "bad_words": ["e"]}, "allowed_token_ids"),
        ({"allowed_token_ids": [101], "stop_token_ids": [101], "min_tokens": 2}, "min_tokens"),
        ({"logit_bias": {str(t): -100 for t in range(257)}}, "logit_bias"),
        ({"logit_bias": {str(t): -100 for t in range(256)}, "min_tokens": 1}, "min_tokens"),
    ],
)
async def test_a_request_forbidding_every_token_is_a_400_naming_the_field(
    make_client: ClientFactory, extra: dict[str, Any], param: str
) -> None:
    async with make_client(CachedMockModel(8), num_slots=8) as client:
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4} | extra)
        assert r.status_code == 400, r.text
        assert field_of(r) == param, r.text
        fine = {"allowed_token_ids": [101, 102], "logit_bias": {"101": -100}}
        text = (await _completion(client, max_tokens=4, **fine))["choices"][0]["text"]
        assert text == "ffff"


@pytest.mark.parametrize("model", mocks(), ids=["mock", "cached-mock"])
async def test_a_ban_emptying_a_row_mid_output_fails_that_request_alone(
    make_client: ClientFactory, model: Model
) -> None:
    """allowed 'a' and bad word 'aa': after one 'a' nothing is left (known only then). The
    client's own bans: a 400, not the model's 500."""
    async with make_client(model, num_slots=8) as client:
        body = {"prompt": "hi", "max_tokens": 4, "allowed_token_ids": [97], "bad_words": ["aa"]}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.headers["x-slotserve-error-code"] == "invalid_value", r.text
        assert "forbid every token" in r.json()["error"]["message"]
        assert (await _completion(client, max_tokens=4))["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_logprobs_stop_at_a_stop_strings_cut(
    make_client: ClientFactory, stream: bool
) -> None:
    """The tokens wholly past a stop string's cut (the stop string's own) leave the logprobs
    too: the logprob tokens spell exactly the returned text, and every offset lies in it."""
    async with make_client(CachedMockModel(8), num_slots=8) as client:
        plain = (await _completion(client, max_tokens=30))["choices"][0]["text"]
        stop = plain[5:7]
        body = {"prompt": "Tell me ", "max_tokens": 30, "stop": [stop], "logprobs": 1}
        r = await client.post("/v1/completions", json=body | {"stream": stream})
        if stream:
            choices = [e.data["choices"][0] for e in parse_sse(r.text)[:-1]]
            text = "".join(c["text"] for c in choices)
            lps = [c["logprobs"] for c in choices if c["logprobs"]]
            tokens, offsets = (
                flat(lp["tokens"] for lp in lps),
                flat(lp["text_offset"] for lp in lps),
            )
        else:
            choice = r.json()["choices"][0]
            text, tokens, offsets = (
                choice["text"],
                choice["logprobs"]["tokens"],
                choice["logprobs"]["text_offset"],
            )
        assert text == plain[: plain.find(stop)]
        assert "".join(tokens) == text and all(offset < len(text) for offset in offsets)
        chat = {"messages": [MESSAGE], "max_tokens": 30, "logprobs": True, "top_logprobs": 1}
        plain = (await client.post("/v1/chat/completions", json=chat)).json()
        content = plain["choices"][0]["message"]["content"]
        stop = content[4:6]
        r = await client.post(
            "/v1/chat/completions", json=chat | {"stop": [stop], "stream": stream}
        )
        if stream:
            choices = [e.data["choices"][0] for e in parse_sse(r.text)[1:-1]]
            text = "".join(c["delta"].get("content", "") for c in choices)
            entries = flat((c["logprobs"] or {}).get("content", []) for c in choices)
        else:
            choice = r.json()["choices"][0]
            text, entries = choice["message"]["content"], choice["logprobs"]["content"]
        assert text == content[: content.find(stop)]
        assert "".join(e["token"] for e in entries) == text


def test_a_token_straddling_the_stop_strings_cut_is_kept() -> None:
    """Multi-character tokens 'ab' 'cd' 'ef' with the stop string 'de': the text is 'abc';
    'cd' shows a character ('c'), so it stays (as vLLM keeps it); 'ef' is dropped."""

    class Pieces:
        def feed(self, ids: Sequence[int]) -> str:
            return "".join(["ab", "cd", "ef"][i] for i in ids)

        def flush(self) -> str:
            return ""

    matcher = StopStringMatcher(["de"])
    aligned = AlignedTokens(Pieces())
    assert aligned.take(matcher, [0, 1], None) == "abc"  # 'd' held back: could start 'de'
    assert aligned.release() == ([0, 1], [None, None])  # 'cd' shows 'c': released
    assert aligned.take(matcher, [2], None) == "" and matcher.hit
    assert aligned.release() == ([], [])  # 'ef' lies wholly past the cut


async def test_a_character_split_across_tokens_keeps_its_true_bytes_and_offsets(
    make_client: ClientFactory,
) -> None:
    """The byte tokenizer splits 'é' into 195 and 169: each logprob entry shows its own byte
    (not U+FFFD's three), and text_offset indexes the text (a split character counts once)."""
    async with make_client(CachedMockModel(8), num_slots=8) as client:
        body = {"prompt": "aé 日b", "max_tokens": 0, "echo": True, "logprobs": 0}
        choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == "aé 日b"
        assert lp["tokens"][:3] == ["a", "bytes:\\xc3", "bytes:\\xa9"]
        assert lp["text_offset"] == [0, 1, 1, 2, 3, 3, 3, 4]
        assert lp["tokens"][-1] == choice["text"][lp["text_offset"][-1]]
        chat = {"messages": [MESSAGE], "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
                "allowed_token_ids": [195, 169]}  # fmt: skip
        for stream in (False, True):
            r = await client.post("/v1/chat/completions", json=chat | {"stream": stream})
            if stream:
                chunks = [e.data["choices"][0] for e in parse_sse(r.text)[1:-1]]
                text = "".join(c["delta"].get("content", "") for c in chunks)
                content = flat((c["logprobs"] or {}).get("content", []) for c in chunks)
            else:
                choice = r.json()["choices"][0]
                text, content = choice["message"]["content"], choice["logprobs"]["content"]
            assert all(len(e["bytes"]) == 1 and e["bytes"][0] in (195, 169) for e in content)
            assert bytes(flat(e["bytes"] for e in content)).decode(errors="replace") == text
            for entry in content:
                assert entry["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in entry["bytes"])


async def test_echo_scores_a_list_of_prompts_as_lm_eval_batches_them(
    make_client: ClientFactory,
) -> None:
    """lm-eval's local-completions sends a list of prompts when batch_size > 1: one choice per
    prompt (n per prompt: choice k answers prompt k // n), in order, usage summed."""
    prompts = ["Hello there", "Bye now", "é?"]
    async with make_client(CachedMockModel(8), num_slots=8) as client:
        body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
        whole = (await client.post("/v1/completions", json=body)).json()
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
        assert [c["text"] for c in whole["choices"]] == prompts
        for choice, prompt in zip(whole["choices"], prompts, strict=True):
            values = choice["logprobs"]["token_logprobs"]
            assert len(values) == len(prompt.encode()) and values[0] is None
        lengths = sum(len(p.encode()) for p in prompts)
        assert whole["usage"] == {"prompt_tokens": lengths, "completion_tokens": 0,
                                  "total_tokens": lengths}  # fmt: skip
        ids = [[72, 105], [66, 121, 101]]
        body = {"prompt": ids, "max_tokens": 3, "n": 2, "echo": True}
        two = (await client.post("/v1/completions", json=body)).json()
        assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
        assert all(c["text"].startswith(("Hi", "Bye")[c["index"] // 2]) for c in two["choices"])
        assert two["usage"]["prompt_tokens"] == 5 and two["usage"]["completion_tokens"] == 12
        r = await client.post("/v1/completions", json=body | {"stream": True})
        chunks = [e.data["choices"][0] for e in parse_sse(r.text)[:-1]]
        for k in range(4):
            text = "".join(c["text"] for c in chunks if c["index"] == k)
            assert text == two["choices"][k]["text"]
            mine = [c for c in chunks if c["index"] == k]  # vLLM's stream: the prompt's ids
            assert mine[0]["prompt_token_ids"] == ids[k // 2]  # come with the echoed prompt
            assert all("prompt_token_ids" not in c for c in mine[1:])


async def test_an_n_that_can_never_fit_is_a_400_not_a_retryable_429(
    make_client: ClientFactory,
) -> None:
    """Review (integration): with 2 slots and a waiting bound of 2, n=9 got 429 queue_full and
    Retry-After on an idle server, though no retry could ever succeed. Now a 400 naming n."""
    async with make_client(MockModel(), num_slots=2, max_waiting=2) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 5}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and field_of(r) == "n", r.text
        assert "retry-after" not in r.headers
        r = await client.post("/v1/chat/completions", json={**body, "n": 4})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        r = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
        assert r.status_code == 400 and field_of(r) == "n", r.text
