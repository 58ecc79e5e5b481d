"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

An adapter over ``app.api.generation``: the body becomes one ``InternalRequest``; the output is
one ``message`` object, or Anthropic's event sequence (``message_start``,
``content_block_start``, ``content_block_delta`` ``text_delta``...,
``content_block_stop``, ``message_delta`` with ``stop_reason`` and usage, ``message_stop``; a
failed model call ends the stream with an ``error`` event). ``stop_reason``: ``end_turn``,
``max_tokens``, ``stop_sequence`` (``stop_sequence`` names it) or ``tool_use``; a request the
server ended early (DELETE, shutdown) reports ``end_turn``, Anthropic having no such reason.
As vLLM answers these routes: no ``ping`` event, usage without Anthropic's cache counters, and
a ``system`` message inside ``messages`` is a system turn where it stands.
Tools (``tools`` with ``input_schema``, ``tool_choice`` auto/any/tool/none) reuse the chat
route's tool machinery (``app.api.tools``: prompt, grammar of a forced call, parsing): a call is
a ``tool_use`` block,
streamed as ``input_json_delta`` pieces. Errors on these routes are in Anthropic's shape
(``anthropic_errors``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api import generation, tools
from app.api.adapters.anthropic_schemas import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolDef,
    ToolResultBlock,
)
from app.api.deps import KeyNameDep, ServingDep
from app.api.errors import ERROR_RESPONSES, APIError, InvalidField, anthropic_type
from app.api.schemas import CalledFunction, ChatMessage, MessageToolCall, joined_text
from app.api.streaming import sse_event
from app.api.tools import ToolPlan
from app.serving import Serving
from app.structured.tools import ToolCall, ToolSpec

router = APIRouter(prefix="/v1", tags=["anthropic"])

STOP_REASONS = {"length": "max_tokens"}  # anything else: end_turn (an abort too)


@router.post("/messages", responses=ERROR_RESPONSES)
async def messages(
    body: MessagesRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    """Generate one assistant message (streamed with ``stream: true``)."""
    plan = tool_plan(body, serving, decide=True)
    internal = generation.InternalRequest(
        prompt=tools.chat_prompt(chat_messages(body), plan, serving), max_tokens=body.max_tokens,
        sampling=body.sampling(), stop_strings=list(body.stop_sequences),
        priority=body.priority, user=body.user(), model=body.model, stream=body.stream,
        id_prefix="msg", tools=plan, constraint=plan.constraint() if plan else None,
        constraint_param="tools",
    )  # fmt: skip
    await serving.precompile(internal.constraint, internal.constraint_param)  # off the loop
    run = generation.start(request, serving, internal, key_name)
    model = run.model  # the model named (a LoRA adapter is echoed), else the served one
    response: Response
    if body.stream:
        response = generation.stream_response(run, serving, MessageEvents(run, model))
    else:
        outcome = (await generation.whole_reply(request, run, serving))[0]
        response = JSONResponse(message_object(run.id, model, outcome))
    return generation.flag_priority(response, serving, internal)


@router.post("/messages/count_tokens", responses=ERROR_RESPONSES)
async def count_tokens(body: CountTokensRequest, serving: ServingDep) -> dict[str, int]:
    """The prompt's length in tokens, as ``/v1/messages`` would send it to the model."""
    generation.adapter(serving, body.model)  # the served model or a LoRA adapter, else 404
    plan = tool_plan(body, serving, decide=False)
    return {"input_tokens": len(tools.chat_prompt(chat_messages(body), plan, serving))}


def tool_plan(body: CountTokensRequest, serving: Serving, decide: bool) -> ToolPlan | None:
    """The tools offered and the choice (None: no tools); 400 naming the field for a server
    tool, a tool without ``input_schema``, or a choice that names no offered tool.
    ``decide``: let a mock decide now whether it calls a tool under ``auto``."""
    field = body.tool_choice
    name = field.name if field is not None and field.type == "tool" else None
    parallel = not (field is not None and field.disable_parallel_tool_use)
    return tools.plan_tools([_spec(tool, index) for index, tool in enumerate(body.tools)],
                            field.type if field else None, name, parallel, serving,
                            name_param="tool_choice.name", decide=decide)  # fmt: skip


def _spec(tool: ToolDef, index: int) -> ToolSpec:
    if tool.type not in (None, "custom"):
        raise InvalidField(f"tool type {tool.type!r} is not supported: this server runs no "
                           "server tools (web search, code execution, bash, ...); give client "
                           "tools with input_schema", param=f"tools.{index}.type",
                           code="unsupported_tool")  # fmt: skip
    if tool.input_schema is None:
        raise InvalidField("a tool needs input_schema", param=f"tools.{index}.input_schema",
                           code="missing")  # fmt: skip
    return ToolSpec(tool.name, tool.description or "", tool.input_schema)


def chat_messages(body: CountTokensRequest) -> list[ChatMessage]:
    """``system`` then each message's blocks as chat messages (a ``tool_use`` becomes an
    assistant's tool call, a ``tool_result`` a tool message; a ``system`` message is a system
    turn where it stands, dropped when it has no text, as vLLM); a ``tool_result`` must answer
    a ``tool_use`` of an earlier assistant message (400 otherwise)."""
    out: list[ChatMessage] = []
    system = joined_text(body.system)
    if system:
        out.append(ChatMessage(role="system", content=system))
    calls: set[str] = set()
    for m, message in enumerate(body.messages):
        texts: list[str] = []
        called: list[MessageToolCall] = []
        results = 0
        for b, block in enumerate(message.blocks()):
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":  # (a system or assistant turn's: say so)
                    raise InvalidField("a tool_result block belongs in a user message",
                                       param=f"messages.{m}.content.{b}")  # fmt: skip
                if block.tool_use_id not in calls:
                    raise InvalidField(f"tool_result block's tool_use_id {block.tool_use_id!r} "
                                       "answers no tool_use block of an earlier assistant message",
                                       param=f"messages.{m}.content.{b}.tool_use_id",
                                       code="unmatched_tool_result")  # fmt: skip
                out.append(ChatMessage(role="tool", content=joined_text(block.content),
                                       tool_call_id=block.tool_use_id))  # fmt: skip
                results += 1
            else:
                if message.role != "assistant":
                    raise InvalidField("a tool_use block belongs in an assistant message",
                                       param=f"messages.{m}.content.{b}")  # fmt: skip
                calls.add(block.id)
                function = CalledFunction(name=block.name, arguments=json.dumps(block.input))
                called.append(MessageToolCall(id=block.id, function=function))
        if message.role == "system" and not "".join(texts):
            continue
        if texts or called or not results:  # (a user turn of only results: just those)
            content = "".join(texts) if texts or not called else None
            out.append(ChatMessage(role=message.role, content=content, tool_calls=called or None))
    return out


def stop_reason(outcome: generation.Outcome) -> str:
    if outcome.calls and outcome.finish_reason == "stop":
        return "tool_use"
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(outcome.finish_reason, "end_turn")


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    """Token usage as vLLM sends it: no cache counters (optional in Anthropic's SDKs)."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:  # cut off by max_tokens: what was generated, as text
        arguments = {"_unparsed": call.arguments}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def message_object(message_id: str, model: str, outcome: generation.Outcome) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": outcome.text}] if outcome.text else []
    content += [tool_use(call) for call in outcome.calls]
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop_reason(outcome),
        "stop_sequence": outcome.stop_sequence,
        "usage": usage(outcome.prompt_tokens, outcome.completion_tokens),
    }  # fmt: skip


def _event(name: str, data: dict[str, Any]) -> bytes:
    return sse_event(name, {"type": name} | data)


class MessageEvents(generation.PartShaper):
    """Anthropic's streamed events for one message (an ``EventShaper``). Without tools the text
    block opens at once (index 0); with tools, each block (text, then one per tool call) opens
    when its first piece comes."""

    def __init__(self, run: generation.Run, model: str) -> None:
        self.run, self.model = run, model
        self.open: str | None = None  # the open block's kind: "text" or "tool_use"
        self.next_index = 0

    def opening(self) -> Iterable[bytes]:
        view = self.run.stream.view
        message: dict[str, Any] = {
            "id": self.run.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(view.prompt_len, 0),
        }  # fmt: skip
        yield _event("message_start", {"message": message})
        if self.run.plan is None:
            yield from self._start({"type": "text", "text": ""})

    def _start(self, block: dict[str, Any]) -> Iterable[bytes]:
        yield from self._stop()
        self.open = str(block["type"])
        yield _event("content_block_start", {"index": self.next_index, "content_block": block})

    def _stop(self) -> Iterable[bytes]:
        if self.open is not None:
            yield _event("content_block_stop", {"index": self.next_index})
            self.open, self.next_index = None, self.next_index + 1

    def text(self, delta: str) -> Iterable[bytes]:
        if self.open != "text":
            yield from self._start({"type": "text", "text": ""})
        piece = {"type": "text_delta", "text": delta}
        yield _event("content_block_delta", {"index": self.next_index, "delta": piece})

    def call_start(self, index: int, call: ToolCall) -> Iterable[bytes]:
        yield from self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})

    def call_arguments(self, index: int, delta: str) -> Iterable[bytes]:
        piece = {"type": "input_json_delta", "partial_json": delta}
        yield _event("content_block_delta", {"index": self.next_index, "delta": piece})

    def closing(self, outcome: generation.Outcome) -> Iterable[bytes]:
        yield from self._stop()
        delta = {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence}
        # the cumulative usage, input tokens too, as vLLM and Anthropic's current API send it
        totals = usage(outcome.prompt_tokens, outcome.completion_tokens)
        yield _event("message_delta", {"delta": delta, "usage": totals})
        yield _event("message_stop", {})

    def failure(self, error: APIError) -> Iterable[bytes]:
        kind = anthropic_type(error.status)
        yield _event("error", {"error": {"type": kind, "message": error.message}})
