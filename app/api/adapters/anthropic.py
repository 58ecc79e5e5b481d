"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

An adapter over ``app.api.generation``: the body becomes one ``InternalRequest``; the output is
one ``message`` object, or Anthropic's event sequence (``message_start``,
``content_block_start``, ``ping``, ``content_block_delta`` ``text_delta``...,
``content_block_stop``, ``message_delta`` with ``stop_reason`` and usage, ``message_stop``; a
failed model call ends the stream with an ``error`` event). ``stop_reason``: ``end_turn``,
``max_tokens``, ``stop_sequence`` (``stop_sequence`` names it), or ``abort`` when the server
ended the request early (vLLM's finish reason). Errors on these routes are in Anthropic's shape
(``anthropic_errors``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api import generation
from app.api.adapters import transcript
from app.api.adapters.anthropic_schemas import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
)
from app.api.deps import KeyNameDep, ServingDep
from app.api.errors import APIError, model_not_found
from app.api.native import ERROR_RESPONSES
from app.api.streaming import sse_event
from app.serving import Serving

router = APIRouter(prefix="/v1", tags=["anthropic"])

STOP_REASONS = {"length": "max_tokens", "abort": "abort"}  # anything else ("stop"): end_turn


@router.post("/messages", responses=ERROR_RESPONSES)
async def messages(
    body: MessagesRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    """Generate one assistant message (streamed with ``stream: true``)."""
    internal = generation.InternalRequest(
        prompt=prompt_ids(body, serving), max_tokens=body.max_tokens, sampling=body.sampling(),
        stop_strings=list(body.stop_sequences), priority=body.priority, user=body.user(),
        model=body.model, stream=body.stream, id_prefix="msg",
    )  # fmt: skip
    run = generation.start(request, serving, internal, key_name)
    model = serving.settings.model_name
    response: Response
    if body.stream:
        response = generation.stream_response(run, serving, MessageEvents(run, model))
    else:
        try:
            outcome = await generation.await_outcome(request, run, serving)
        except generation.ModelFailed as err:
            raise APIError(500, str(err), "server_error", code="model_error") from err
        response = JSONResponse(message_object(run.id, model, outcome))
    return generation.flag_priority(response, serving, internal)


@router.post("/messages/count_tokens", responses=ERROR_RESPONSES)
async def count_tokens(body: CountTokensRequest, serving: ServingDep) -> dict[str, int]:
    """The prompt's length in tokens, as ``/v1/messages`` would send it to the model."""
    if body.model is not None and body.model != serving.settings.model_name:
        raise model_not_found(body.model, serving.settings.model_name)
    return {"input_tokens": len(prompt_ids(body, serving))}


def prompt_ids(body: CountTokensRequest, serving: Serving) -> list[int]:
    """The conversation through the model's chat template (400 for what it cannot take)."""
    unsupported = body.unsupported()
    if unsupported is not None:
        raise APIError(400, f"{unsupported} is not supported by this server yet; leave it unset",
                       param=unsupported, code="unsupported_parameter")  # fmt: skip
    return serving.tokenizer.chat_prompt(turns(body))


def turns(body: CountTokensRequest) -> list[transcript.Turn]:
    """``system`` then each message's blocks as chat turns; a ``tool_result`` must answer a
    ``tool_use`` of an earlier assistant message (400 otherwise)."""
    out: list[transcript.Turn] = []
    system = body.system_text()
    if system:
        out.append(("system", system))
    calls: set[str] = set()
    for m, message in enumerate(body.messages):
        for b, block in enumerate(message.blocks()):
            if isinstance(block, TextBlock):
                out.append((message.role, block.text))
            elif isinstance(block, ToolResultBlock):
                if message.role != "user" or block.tool_use_id not in calls:
                    raise _unmatched(block, f"messages.{m}.content.{b}.tool_use_id")
                out.append(("tool", block.text()))
            else:
                if message.role != "assistant":
                    raise APIError(400, "a tool_use block belongs in an assistant message",
                                   param=f"messages.{m}.content.{b}")  # fmt: skip
                calls.add(block.id)
                out.append(("assistant", transcript.tool_call_text(block.name, block.input)))
    return transcript.merge(out)


def _unmatched(block: ToolResultBlock, param: str) -> APIError:
    return APIError(400, f"tool_result block's tool_use_id {block.tool_use_id!r} answers no "
                    "tool_use block of an earlier assistant message", param=param,
                    code="unmatched_tool_result")  # fmt: skip


def stop_reason(outcome: generation.Outcome) -> str:
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(outcome.finish_reason, "end_turn")


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip


def message_object(message_id: str, model: str, outcome: generation.Outcome) -> dict[str, Any]:
    content = [{"type": "text", "text": outcome.text}] if outcome.text else []
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop_reason(outcome),
        "stop_sequence": outcome.stop_sequence,
        "usage": usage(outcome.prompt_tokens, outcome.completion_tokens),
    }  # fmt: skip


def _event(name: str, data: dict[str, Any]) -> bytes:
    return sse_event(name, {"type": name} | data)


class MessageEvents:
    """Anthropic's streamed events for one message (an ``EventShaper``)."""

    def __init__(self, run: generation.Run, model: str) -> None:
        self.run, self.model = run, model

    def opening(self) -> Iterable[bytes]:
        seq = self.run.stream.seq
        message: dict[str, Any] = {
            "id": self.run.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(seq.prompt_len, 0),
        }  # fmt: skip
        yield _event("message_start", {"message": message})
        block = {"type": "text", "text": ""}
        yield _event("content_block_start", {"index": 0, "content_block": block})
        yield _event("ping", {})

    def text(self, delta: str) -> Iterable[bytes]:
        yield _event("content_block_delta",
                     {"index": 0, "delta": {"type": "text_delta", "text": delta}})  # fmt: skip

    def closing(self, outcome: generation.Outcome) -> Iterable[bytes]:
        yield _event("content_block_stop", {"index": 0})
        delta = {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence}
        usage = {"output_tokens": outcome.completion_tokens}
        yield _event("message_delta", {"delta": delta, "usage": usage})
        yield _event("message_stop", {})

    def failure(self, message: str) -> Iterable[bytes]:
        yield _event("error", {"error": {"type": "api_error", "message": message}})
