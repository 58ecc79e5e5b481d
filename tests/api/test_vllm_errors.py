"""Error answers in vLLM's two families (app/api/errors.py), as vLLM 0.32 answered the same
requests (tests/parity/data/vllm_capture.json): its request schema's errors (``Bad Request``,
``param`` ``body.<path>``) and its own checks (``BadRequestError``, ``param`` the field or null);
our precise field always in ``X-Slotserve-Error-Param``. And integers read as vLLM reads them."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import pytest
from conftest import ClientFactory
from error_shape import field_of

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "type_", "param", "field"),
    [
        # vLLM's own checks that leave param null (its message names the field)
        ("/v1/completions", CMPL | {"n": 0}, "BadRequestError", None, "n"),
        ("/v1/completions", CMPL | {"n": 2, "temperature": 0}, "BadRequestError", None, "n"),
        ("/v1/completions", CMPL | {"presence_penalty": 3}, "BadRequestError", None,
         "presence_penalty"),
        ("/v1/completions", CMPL | {"repetition_penalty": 0}, "BadRequestError", None,
         "repetition_penalty"),
        ("/v1/completions", {"prompt": [999999], "max_tokens": 2}, "BadRequestError", None,
         "prompt"),
        ("/v1/chat/completions", CHAT | {"messages": []}, "BadRequestError", None, "messages"),
        # vLLM's own checks naming the field as vLLM does
        ("/v1/completions", {"max_tokens": 2}, "BadRequestError", "prompt", "prompt"),
        ("/v1/completions", CMPL | {"temperature": 2.5}, "BadRequestError", "temperature",
         "temperature"),
        ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 50},
         "BadRequestError", "logprobs", "top_logprobs"),
        ("/v1/chat/completions", CHAT | {"logit_bias": {"abc": 1}}, "BadRequestError",
         "logit_bias", "logit_bias.abc"),
        ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema"}},
         "BadRequestError", "response_format", "response_format.json_schema"),
        # vLLM's schema: the first error's location (a union field's is the field itself)
        ("/v1/completions", CMPL | {"stop": [1]}, "Bad Request", "body.stop", "stop.0"),
        ("/v1/completions", CMPL | {"seed": 2**64}, "Bad Request", "body.seed", "seed"),
        ("/tokenize", {}, "Bad Request", "body.prompt", "prompt"),
    ],
)  # fmt: skip
async def test_errors_answer_in_vllms_family_with_our_field_in_a_header(
    make_client: ClientFactory,
    path: str,
    body: dict[str, Any],
    type_: str,
    param: str | None,
    field: str,
) -> None:
    async with make_client() as client:
        r = await client.post(path, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and (error["type"], error["param"]) == (type_, param), r.text
        assert field_of(r) == field and field.split(".")[0] in error["message"]


@pytest.mark.parametrize(
    ("extra", "accepted"),
    [
        ({"max_tokens": "3"}, True),
        ({"max_tokens": 3.0}, True),
        ({"seed": "7"}, True),
        ({"n": "1"}, True),
        ({"logprobs": "2"}, True),
        ({"repetition_penalty": 3}, True),  # vLLM bounds it below only
        ({"max_tokens": 3.5}, False),
        ({"max_tokens": "3.5"}, False),
        ({"seed": "seven"}, False),
    ],
)
async def test_integers_are_read_as_vllm_reads_them(
    make_client: ClientFactory, extra: dict[str, Any], accepted: bool
) -> None:
    """pydantic's lax mode, as vLLM's schema: "3" and 3.0 are 3; 3.5 and "seven" are not."""
    async with make_client() as client:
        r = await client.post("/v1/completions", json=CMPL | extra)
        assert (r.status_code == 200) == accepted, r.text
        if accepted and "max_tokens" in extra:
            assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("extra", "accepted"),
    [
        ({"echo": "false"}, True),
        ({"echo": 0}, True),
        ({"ignore_eos": "yes"}, True),
        ({"stream": "false"}, True),
        ({"echo": "sometimes"}, False),
        ({"echo": 2}, False),
    ],
)
async def test_booleans_are_read_as_vllm_reads_them(
    make_client: ClientFactory, extra: dict[str, Any], accepted: bool
) -> None:
    """pydantic's lax mode, as vLLM's schema: "false", 0, "yes" are booleans; 2 is not."""
    async with make_client() as client:
        r = await client.post("/v1/completions", json=CMPL | extra)
        assert (r.status_code == 200) == accepted, r.text
        if not accepted:
            assert field_of(r) == next(iter(extra))


async def test_a_long_client_key_in_the_param_header_is_cut_between_characters(
    make_client: ClientFactory,
) -> None:
    """The header holds at most 256 characters of a client's key, percent-encoded: a long
    non-ASCII key is cut before a character, never inside its escapes (a strict decoder, as
    JavaScript's decodeURIComponent, would refuse ``%C3%A``), and its start is the key's."""
    key = "é" * 200
    async with make_client() as client:
        r = await client.post("/v1/chat/completions", json=CHAT | {"logit_bias": {key: 1}})
    header = r.headers["x-slotserve-error-param"]
    assert r.status_code == 400 and len(header) <= 256
    assert unquote(header, errors="strict") == "logit_bias." + key[: (256 - 11) // 6]


@pytest.mark.parametrize(
    ("prompt", "field", "says"),
    [
        (["a"] * 300, "prompt", "at most 256 items"),
        ([[1]] * 300, "prompt", "at most 256 items"),
    ],
)
async def test_a_lax_integer_member_does_not_hide_the_union_member_that_matched(
    make_client: ClientFactory, prompt: list[Any], field: str, says: str
) -> None:
    """Review: with integers read laxly, the token-id member's "unable to parse string as an
    integer" was taken for the specific error, so 300 text prompts answered "prompt.0: Input
    should be a valid integer" rather than that the list is too long."""
    async with make_client() as client:
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and field_of(r) == field and says in message, r.text
