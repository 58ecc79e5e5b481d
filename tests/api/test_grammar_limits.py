"""A grammar llguidance gives up on mid-decode (its limits on the work per token, reached by a
very ambiguous grammar) ends the request as the client's problem: ``GrammarLimitError`` in the
engine, a 400 ``invalid_grammar`` naming the request's grammar field through the API (the
stream's error event when streamed). A token the grammar forbids stays a model error (500)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import ClientFactory
from error_shape import field_of
from server_process import ServerProcess, running_server
from sse import parse_sse
from test_structured import COMPILER, MaskedRandomModel, constrained, drive, replays

from app.api import generation
from app.api.errors import generation_failed
from app.engine.errors import GrammarLimitError, ModelOutputError
from app.engine.types import FinishReason
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import NO_TOKEN, StepBatch
from app.models.tokenizer import EOS_TOKEN_ID
from app.structured.constraint import Constraint
from app.structured.grammar import allowed

# Compiles at once; every generated character makes llguidance's Earley rows grow (x splits
# into 2..16 parts in every way), past its 2000 items a row within ~20 tokens.
AMBIGUOUS = 'start: x "!"\nx: ' + " | ".join(" ".join(["x"] * k) for k in range(2, 17))
AMBIGUOUS += " | /[^!]/\n"
LIMIT_MESSAGE = "Current row has"  # llguidance's words for its items-per-row limit


def test_a_grammar_llguidance_gives_up_on_ends_the_request_with_a_grammar_limit_error() -> None:
    """With a mock (steered by the matcher) and with a model that samples under the masks."""
    grammar = Constraint.grammar(AMBIGUOUS)
    for model in (MockModel(MockLanguage()), MaskedRandomModel(seed=1)):
        seq = constrained("r", b"hi", grammar, 1000)
        drive(model, [seq], num_slots=1)
        assert seq.finish_reason is FinishReason.ERROR
        assert isinstance(seq.error, GrammarLimitError), seq.error
        message = str(seq.error)
        assert message.startswith(LIMIT_MESSAGE) and "max is 2000" in message
        assert "<state>" not in message and len(message) <= 300  # no parser dump
        assert 0 < seq.num_generated < 100 and replays(grammar, seq.generated)


def test_after_giving_up_the_matcher_does_not_let_the_request_end_as_if_its_grammar_had() -> None:
    """llguidance's masks then allow only EOS, and it would take EOS: the request would end
    with ``stop`` and a cut-off output that does not match its grammar."""
    matcher = COMPILER.matcher(Constraint.grammar(AMBIGUOUS))
    for _ in range(100):
        if not matcher.accept(ord("a")):
            break
    else:
        pytest.fail("llguidance never gave up on the ambiguous grammar")
    assert isinstance(matcher.refusal(ord("a")), GrammarLimitError)
    mask = matcher.mask()
    assert [t for t in range(EOS_TOKEN_ID + 1) if allowed(mask, t)] == [EOS_TOKEN_ID]
    assert not matcher.accept(EOS_TOKEN_ID)
    assert LIMIT_MESSAGE in str(matcher.refusal(EOS_TOKEN_ID))


def test_a_token_the_grammar_forbids_is_a_model_error_not_the_clients() -> None:
    matcher = COMPILER.matcher(Constraint.regex("[0-9]+"))
    assert matcher.accept(ord("1"))
    assert not matcher.accept(ord("a"))
    refusal = matcher.refusal(ord("a"))
    assert isinstance(refusal, ModelOutputError) and not isinstance(refusal, GrammarLimitError)


def test_an_id_outside_the_vocabulary_is_a_model_error_not_the_clients() -> None:
    """Review: every llguidance error but "doesn't satisfy the grammar" was taken for a limit,
    so a model's out-of-range id was answered as the client's 400 invalid_grammar."""
    matcher = COMPILER.matcher(Constraint.regex("[0-9]+"))
    assert not matcher.accept(5000)
    refusal = matcher.refusal(5000)
    assert isinstance(refusal, ModelOutputError) and not isinstance(refusal, GrammarLimitError)


def test_the_api_answers_a_grammar_limit_400_and_a_model_failure_500() -> None:
    limit = generation_failed(GrammarLimitError("Current row has 2003 items"), "tools")
    assert (limit.status, limit.code, limit.param) == (400, "invalid_grammar", "tools")
    assert limit.message.startswith("tools: ") and "Current row has 2003 items" in limit.message
    failed = generation_failed(ModelOutputError("bad token"), "response_format")
    assert (failed.status, failed.code, failed.type) == (500, "model_error", "InternalServerError")


class BannedModel(MaskedRandomModel):
    """A model whose every masked row is refused by the request's bans: it reports
    ``NO_TOKEN``, as the real model's sampler does when ``allowed_token_ids`` (or ``logit_bias``
    -100, ``bad_words``) leaves nothing of what the grammar allows."""

    def step(self, batch: StepBatch) -> list[int]:
        return [NO_TOKEN] * batch.num_outputs


def test_bans_that_leave_no_token_the_grammar_allows_are_the_clients_400_not_a_500() -> None:
    """Review: ``allowed_token_ids`` that exclude every token of a grammar's text ended the
    request as a model error: a 500 "model call failed" for the client's own request."""
    seq = constrained("r", b"hi", Constraint.choice(["yes", "no"]), 10)
    drive(BannedModel(seed=1), [seq], num_slots=1)
    assert seq.finish_reason is FinishReason.ERROR and "no token is left" in str(seq.error)
    answer = generation_failed(seq.error, "structured_outputs")
    assert (answer.status, answer.code, answer.type) == (400, "invalid_value", "BadRequestError")


# llguidance's own limits, without the server's CPU budget (which, timed, may come first:
# tests/api/test_grammar_budget.py)
NO_BUDGET = {"max_grammar_ms_per_token": 0, "max_grammar_ms_per_request": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    flags = ("--max-grammar-ms-per-token", "0", "--max-grammar-ms-per-request", "0")
    with running_server("--num-slots", "2", *flags) as running:
        yield running


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


GRAMMAR_BODY = {"structured_outputs": {"grammar": AMBIGUOUS}}


def test_the_openai_sdk_gets_a_400_naming_the_grammar_field(server: ServerProcess) -> None:
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="slotserve-mock", messages=[{"role": "user", "content": "hi"}],
            max_tokens=500, extra_body=GRAMMAR_BODY,
        )  # fmt: skip
    assert caught.value.response.headers["x-slotserve-error-code"] == "invalid_grammar"
    assert caught.value.param == "structured_outputs.grammar"
    assert LIMIT_MESSAGE in caught.value.message and "<state>" not in caught.value.message
    with pytest.raises(openai.BadRequestError) as on_completions:
        client.completions.create(
            model="slotserve-mock", prompt="hi", max_tokens=500, extra_body=GRAMMAR_BODY
        )
    assert on_completions.value.response.headers["x-slotserve-error-code"] == "invalid_grammar"
    reply = client.chat.completions.create(  # the server is fine: its slots were freed
        model="slotserve-mock", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert reply.choices[0].finish_reason == "length"


def test_a_streamed_request_ends_with_the_one_error_event(server: ServerProcess) -> None:
    client = _client(server)
    stream = client.chat.completions.create(
        model="slotserve-mock", messages=[{"role": "user", "content": "hi"}],
        max_tokens=500, stream=True, extra_body=GRAMMAR_BODY,
    )  # fmt: skip
    text: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            text += [c.delta.content or "" for c in chunk.choices]
    assert "".join(text)  # the text before it gave up was sent
    assert LIMIT_MESSAGE in caught.value.message
    assert isinstance(caught.value.body, dict)
    assert (caught.value.body["type"], caught.value.body["code"]) == ("BadRequestError", 400)
    assert field_of(caught.value.body) == "structured_outputs.grammar"


async def test_responses_and_messages_answer_it_in_their_own_shapes(
    make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their grammars come from tools or ``text.format`` (JSON schemas, which do not reach the
    limits): here the internal request gets the ambiguous grammar, blamed on ``tools``."""
    real_start = generation.start

    def start(request: Any, serving: Any, internal: generation.InternalRequest, key: Any) -> Any:
        grammar = Constraint.grammar(AMBIGUOUS)
        internal = dataclasses.replace(internal, constraint=grammar, constraint_param="tools")
        return real_start(request, serving, internal, key)

    monkeypatch.setattr(generation, "start", start)
    async with make_client(**NO_BUDGET) as client:
        body: dict[str, Any] = {"input": "hi", "max_output_tokens": 500}
        whole = await client.post("/v1/responses", json=body)
        assert whole.status_code == 400, whole.text
        error = whole.json()["error"]
        assert (whole.headers["x-slotserve-error-code"], field_of(error)) == (
            "invalid_grammar",
            "tools",
        )
        assert LIMIT_MESSAGE in error["message"]
        events = await client.post("/v1/responses", json=body | {"stream": True})
        streamed = parse_sse(events.text)
        assert streamed[-1].event == "response.failed"
        failed = streamed[-1].data["response"]["error"]
        assert failed["code"] == "invalid_grammar" and LIMIT_MESSAGE in failed["message"]

        body = {"max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}
        whole = await client.post("/v1/messages", json=body)
        assert whole.status_code == 400, whole.text
        assert whole.json()["error"]["type"] == "invalid_request_error"
        assert whole.json()["error"]["message"].startswith("tools: ")
        events = await client.post("/v1/messages", json=body | {"stream": True})
        streamed = parse_sse(events.text)
        assert streamed[-1].event == "error"
        assert streamed[-1].data["error"]["type"] == "invalid_request_error"
        assert LIMIT_MESSAGE in streamed[-1].data["error"]["message"]
