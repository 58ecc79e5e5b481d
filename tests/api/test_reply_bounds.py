"""Bounds on the size of a reply (issue 27, finding 2): its log probabilities (``n`` x tokens x
alternatives, counted as each route renders them, and ``n`` x prompt tokens with prompt log
probabilities) refused with a 400 naming the fields before the request is admitted, what
lm-evaluation-harness sends still served; and the bytes of a whole reply."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import ClientFactory
from error_shape import field_of
from server_process import ServerProcess, running_server

MODEL = "slotserve-mock"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server() as server:  # default flags, as the attack found them
        yield server


def test_n_times_prompt_logprobs_is_refused_before_admission(server: ServerProcess) -> None:
    """The attack of the issue: one 8k-token prompt, 16 choices, each echoing it with 20
    alternatives per token (211 MB and 1.77 GB of RSS on main): a 400 at once, nothing run."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=20)
    prompt = [ord("a") + i % 26 for i in range(8184)]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt=prompt, n=16, echo=True, logprobs=20,
                                      max_tokens=8, stream=stream,
                                      extra_body={"prompt_logprobs": 20})  # fmt: skip
        error = bad.value.body
        assert (
            isinstance(error, dict)
            and bad.value.response.headers["x-slotserve-error-code"] == "too_many_logprobs"
        )
        assert field_of(error) == "prompt_logprobs" and "n (16)" in error["message"]
    metrics = httpx.get(server.url + "/metrics").text
    assert (
        'vllm:prompt_tokens_total{engine="0",model_name="slotserve-mock"} 0.0' in metrics
    )  # not admitted


async def test_chat_top_logprobs_times_n_is_refused(make_client: ClientFactory) -> None:
    """The issue's 122-byte chat request (38 MB of reply on main)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 16, "logprobs": True,
            "top_logprobs": 20, "max_tokens": 2000}  # fmt: skip
    async with make_client() as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text[:200]
        error = r.json()["error"]
        assert (
            field_of(error) == "top_logprobs"
            and r.headers["x-slotserve-error-code"] == "too_many_logprobs"
        )
        for field in ("top_logprobs", "n", "max_completion_tokens", "--max-logprob-entries"):
            assert field in error["message"]
        ok = await client.post("/v1/chat/completions", json=body | {"max_tokens": 200})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 16


async def test_chat_prompt_logprobs_count_every_choices_prefill(
    make_client: ClientFactory,
) -> None:
    """Chat shows the prompt's log probabilities once, but each choice computes them."""
    body = {"messages": [{"role": "user", "content": "x" * 500}], "max_tokens": 1,
            "prompt_logprobs": 0}  # fmt: skip
    async with make_client(max_model_len=1024) as client:  # bound: 8 x 1024 prompt tokens
        assert (await client.post("/v1/chat/completions", json=body | {"n": 8})).status_code == 200
        r = await client.post("/v1/chat/completions", json=body | {"n": 16})
        assert r.status_code == 400 and field_of(r.json()["error"]) == "prompt_logprobs"


async def test_lm_eval_loglikelihood_batches_up_to_eight_full_contexts(
    make_client: ClientFactory,
) -> None:
    """lm-evaluation-harness's ``local-completions`` scores a batch of prompts with ``echo``,
    ``logprobs: 1``, ``max_tokens: 1``: eight prompts filling the context pass, a ninth is a
    400 telling which bound to raise; the flags raise it."""
    context = 256
    prompt = [ord("a") + i % 26 for i in range(context - 1)]
    body = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    async with make_client(max_model_len=context) as client:
        r = await client.post("/v1/completions", json=body | {"prompt": [prompt] * 8})
        assert r.status_code == 200
        assert all(len(c["logprobs"]["tokens"]) == context for c in r.json()["choices"])
        r = await client.post("/v1/completions", json=body | {"prompt": [prompt] * 9})
        assert r.status_code == 400
        assert "--max-prompt-logprob-tokens" in r.json()["error"]["message"]
    raised = {"max_model_len": context, "max_prompt_logprob_tokens": 9 * context,
              "max_logprob_entries": 40 * context}  # fmt: skip
    async with make_client(**raised) as client:
        r = await client.post("/v1/completions", json=body | {"prompt": [prompt] * 9})
        assert r.status_code == 200


async def test_responses_top_logprobs_are_bounded(make_client: ClientFactory) -> None:
    body = {"input": "hi", "max_output_tokens": 1000, "top_logprobs": 20,
            "include": ["message.output_text.logprobs"]}  # fmt: skip
    async with make_client(max_logprob_entries=20_000) as client:
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 400 and field_of(r.json()["error"]) == "top_logprobs"
        r = await client.post("/v1/responses", json=body | {"max_output_tokens": 900})
        assert r.status_code == 200


async def test_a_whole_reply_past_the_byte_bound_is_a_400(make_client: ClientFactory) -> None:
    """``--max-response-bytes``: a whole reply bigger than it is never held for the client (a
    stream sends its events as they come instead)."""
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "n": 4}
    async with make_client(max_response_bytes=2048, mock_stop_probability=0) as client:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.headers["x-slotserve-error-code"] == "response_too_large"
        assert "--max-response-bytes (2048)" in r.json()["error"]["message"]
        streamed = await client.post("/v1/completions", json=body | {"stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        response = {"input": "x", "max_output_tokens": 2000}
        r = await client.post("/v1/responses", json=response)
        assert r.status_code == 400 and r.headers["x-slotserve-error-code"] == "response_too_large"
        small = await client.post("/v1/completions", json=body | {"max_tokens": 5})
        assert small.status_code == 200
