"""OpenAI's Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``.

An adapter over ``app.api.generation``: ``input`` (a string or items) and ``instructions``,
after the stored conversation of ``previous_response_id`` if given, become one
``InternalRequest``. The output is one ``response`` object, or OpenAI's typed events, each with
its ``sequence_number`` (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed``, ``response.incomplete`` or, when a
model call fails, ``response.failed``). ``background: true`` answers at once (status
``queued``) and generates detached from the connection; ``cancel`` aborts it (its slot is free
before the next step). Stored responses live in ``responses_store``. Status: ``completed``
(end of sequence), ``incomplete`` (``max_output_tokens``), ``cancelled`` (cancelled, or ended
early by the server), ``failed``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api import generation
from app.api.adapters import transcript
from app.api.adapters.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ResponsesRequest,
)
from app.api.adapters.responses_store import ResponseStore, Stored
from app.api.deps import KeyNameDep, ServingDep
from app.api.errors import APIError
from app.api.native import ERROR_RESPONSES
from app.api.streaming import sse_event
from app.serving import Serving
from app.structured.constraint import Constraint

router = APIRouter(prefix="/v1", tags=["openai"])
NEUTRAL_TOOL_CHOICE = (None, "auto", "none")


def response_store(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.responses
    return store


@router.post("/responses", responses=ERROR_RESPONSES)
async def create(
    body: ResponsesRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    """Create a response (streamed with ``stream: true``; detached with ``background: true``)."""
    store = response_store(request)
    _check_options(body, store)
    previous = _previous(body, store)
    turns, calls = conversation(body, previous)
    system = [("system", body.instructions)] if body.instructions else []
    internal = generation.InternalRequest(
        prompt=serving.tokenizer.chat_prompt(system + turns), max_tokens=body.max_output_tokens,
        sampling=body.sampling(), priority=body.priority, user=body.user, model=body.model,
        stream=bool(body.stream), id_prefix="resp", constraint=text_constraint(body),
        constraint_param="text.format.schema",
    )  # fmt: skip
    run = generation.start(request, serving, internal, key_name)
    shape = ResponseShape(run, body, serving.settings.model_name)
    entry = Stored(run.id, shape.object("queued"), turns, calls, background=bool(body.background))
    response: Response
    if body.background:
        store.put(entry)
        entry.task = asyncio.create_task(_background(run, serving, shape, entry, store))
        response = JSONResponse(entry.response)
    elif body.stream:
        keep = _keeper(store, entry) if body.store else _discard
        response = generation.stream_response(run, serving, ResponseEvents(shape, keep))
    else:
        try:
            outcome = await generation.await_outcome(request, run, serving)
        except generation.ModelFailed as err:
            raise APIError(500, str(err), "server_error", code="model_error") from err
        entry.response = shape.finished(outcome)
        if body.store:
            _keeper(store, entry)(entry.response, outcome.text)
        response = JSONResponse(entry.response)
    return generation.flag_priority(response, serving, internal)


@router.get("/responses/{response_id}", responses={404: {"description": "unknown response"}})
async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response as last reported (a background one: its status now)."""
    return _stored(response_store(request), response_id).response


@router.post("/responses/{response_id}/cancel", responses=ERROR_RESPONSES)
async def cancel(response_id: str, request: Request, serving: ServingDep) -> dict[str, Any]:
    """Cancel a background response: it ends ``cancelled`` and its slot is free before the
    next step. Cancelling it again answers the same; a response that was not created in the
    background, or that has already finished otherwise, is a 400 (as vLLM answers)."""
    entry = _stored(response_store(request), response_id)
    if not entry.background:
        raise APIError(400, "Cannot cancel a synchronous response.", param="response_id",
                       code="not_cancellable")  # fmt: skip
    if entry.status == "cancelled":
        return entry.response
    if not entry.running:
        raise APIError(400, f"Cannot cancel a response that is already {entry.status}.",
                       param="response_id", code="not_cancellable")  # fmt: skip
    entry.cancelled = True
    await serving.cancel(entry.id)
    if entry.task is not None:
        await asyncio.shield(entry.task)
    return entry.response


def _check_options(body: ResponsesRequest, store: ResponseStore) -> None:
    """400 for what this server does not do: built-in tools (named), function tools (until
    they are wired in), a background response that is not stored or is streamed."""
    for index, tool in enumerate(body.tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"tool type {kind!r} is not supported: this server runs no "
                           "built-in tools (web search, file search, code interpreter, ...)",
                           param=f"tools.{index}.type", code="unsupported_tool")  # fmt: skip
    if body.tools:
        raise _unsupported("tools", "function tools are not supported by this server yet")
    if body.tool_choice not in NEUTRAL_TOOL_CHOICE:
        raise _unsupported("tool_choice", "tool_choice needs tools")
    if body.background and (not body.store or not store.enabled):
        raise _unsupported("background", "background responses must be stored (store: true, "
                           "and the server's --responses-store-size above 0)")  # fmt: skip
    if body.background and body.stream:
        raise _unsupported("stream", "a background response cannot be streamed here; poll it "
                           "with GET /v1/responses/{id}")  # fmt: skip


def text_constraint(body: ResponsesRequest) -> Constraint | None:
    """``text.format`` as the output's constraint (the same grammar path as chat's
    ``response_format``): none for ``text``; 400 for a format this server does not know."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint.json_object()
    if fmt.type != "json_schema":
        raise _unsupported("text.format.type", f"text.format type {fmt.type!r} is not "
                           "supported: text, json_object or json_schema")  # fmt: skip
    if fmt.schema_ is None:
        raise APIError(400, "text.format.schema is required with type json_schema",
                       param="text.format.schema", code="missing")  # fmt: skip
    return Constraint.json_schema(fmt.schema_)


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def _previous(body: ResponsesRequest, store: ResponseStore) -> Stored | None:
    if body.previous_response_id is None:
        return None
    entry = _stored(store, body.previous_response_id, param="previous_response_id")
    if entry.running:
        raise APIError(400, f"previous response {entry.id!r} is still {entry.status}",
                       param="previous_response_id", code="previous_response_running")  # fmt: skip
    return entry


def _stored(store: ResponseStore, response_id: str, param: str = "response_id") -> Stored:
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response with id {response_id!r} (responses are kept "
                       "in memory, bounded in count and age, and lost on restart)",
                       "not_found_error", param=param, code="response_not_found")  # fmt: skip
    return entry


def conversation(
    body: ResponsesRequest, previous: Stored | None
) -> tuple[list[transcript.Turn], set[str]]:
    """The previous response's conversation (if any) followed by this input, as chat turns,
    and the function call ids seen; a ``function_call_output`` must answer one (400)."""
    turns = list(previous.turns) if previous is not None else []
    calls = set(previous.calls) if previous is not None else set()
    for index, item in enumerate(body.items()):
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            turns.append(("assistant", transcript.tool_call_text(item.name, item.arguments)))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise APIError(400, f"function_call_output's call_id {item.call_id!r} answers "
                               "no function_call item before it", param=f"input.{index}.call_id",
                               code="unmatched_function_call_output")  # fmt: skip
            turns.append(("tool", item.text()))
        else:
            role = "system" if item.role == "developer" else item.role
            turns.append((role, item.text()))
    return transcript.merge(turns), calls


def _keeper(store: ResponseStore, entry: Stored) -> Callable[[dict[str, Any], str], None]:
    """Stores ``entry`` once it is finished (its object and output text)."""

    def keep(final: dict[str, Any], text: str) -> None:
        entry.response = final
        entry.turns = transcript.merge([*entry.turns, ("assistant", text)])
        store.finished(entry)
        store.put(entry)

    return keep


def _discard(final: dict[str, Any], text: str) -> None:
    return None


async def _background(
    run: generation.Run, serving: Serving, shape: ResponseShape, entry: Stored,
    store: ResponseStore,
) -> None:  # fmt: skip
    """Generate a background response, detached from its connection, into its entry."""
    entry.response = shape.object("in_progress")
    try:
        outcome = await generation.collect(run, serving)
    except generation.ModelFailed as err:
        entry.response = shape.failed(str(err))
        store.finished(entry)
        return
    cancelled = entry.cancelled and outcome.finish_reason == "abort"
    final = shape.finished(outcome, "cancelled" if cancelled else None)
    _keeper(store, entry)(final, outcome.text)


class ResponseShape:
    """The ``response`` object of one request, at any status."""

    def __init__(self, run: generation.Run, body: ResponsesRequest, model: str) -> None:
        self.run, self.body, self.model = run, body, model
        self.id = run.id
        self.message_id = f"msg-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def object(
        self, status: str, output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None, **extra: Any,
    ) -> dict[str, Any]:  # fmt: skip
        body = self.body
        fmt = body.text.format.echo() if body.text and body.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": bool(body.background), "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model, "output": output or [], "parallel_tool_calls": True,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools,
            "text": {"format": fmt or {"type": "text"}}, "truncation": "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
            "store": body.store is not False,
        } | extra  # fmt: skip

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}  # fmt: skip

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def finished(self, outcome: generation.Outcome, status: str | None = None) -> dict[str, Any]:
        """The object of a finished response (``status`` overrides the one ``outcome`` gives)."""
        reason = outcome.finish_reason
        status = status or {"length": "incomplete", "abort": "cancelled"}.get(reason, "completed")
        incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
        item = self.message(outcome.text, "completed" if status == "completed" else "incomplete")
        usage = {
            "input_tokens": outcome.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": outcome.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        }  # fmt: skip
        return self.object(status, [item], usage, incomplete_details=incomplete)

    def failed(self, message: str) -> dict[str, Any]:
        return self.object("failed", error={"code": "server_error", "message": message})


class ResponseEvents:
    """OpenAI's typed Responses events for one response (an ``EventShaper``); ``keep`` gets
    the final object and the output text (to store them)."""

    def __init__(self, shape: ResponseShape, keep: Callable[[dict[str, Any], str], None]) -> None:
        self.shape, self.keep = shape, keep
        self.sequence = 0

    def _event(self, name: str, **data: Any) -> bytes:
        event = {"type": name, "sequence_number": self.sequence} | data
        self.sequence += 1
        return sse_event(name, event)

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.shape.message_id, "output_index": 0, "content_index": 0}

    def opening(self) -> Iterable[bytes]:
        shape = self.shape
        yield self._event("response.created", response=shape.object("in_progress"))
        yield self._event("response.in_progress", response=shape.object("in_progress"))
        yield self._event("response.output_item.added", output_index=0,
                          item=shape.message(None, "in_progress"))  # fmt: skip
        yield self._event("response.content_part.added", **self._at(), part=shape.part(""))

    def text(self, delta: str) -> Iterable[bytes]:
        yield self._event("response.output_text.delta", **self._at(), delta=delta, logprobs=[])

    def closing(self, outcome: generation.Outcome) -> Iterable[bytes]:
        shape, text = self.shape, outcome.text
        final = shape.finished(outcome)
        yield self._event("response.output_text.done", **self._at(), text=text, logprobs=[])
        yield self._event("response.content_part.done", **self._at(), part=shape.part(text))
        yield self._event("response.output_item.done", output_index=0, item=final["output"][0])
        self.keep(final, text)
        terminal = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self._event(terminal, response=final)

    def failure(self, message: str) -> Iterable[bytes]:
        final = self.shape.failed(message)
        self.keep(final, "")
        yield self._event("response.failed", response=final)
