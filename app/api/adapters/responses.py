"""OpenAI's Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``.

An adapter over ``app.api.generation``: ``input`` (a string or items) and ``instructions``,
after the stored conversation of ``previous_response_id`` if given, become one
``InternalRequest``. The output is one ``response`` object, or OpenAI's typed events, each with
its ``sequence_number`` (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed`` (whatever the status: an incomplete
or cancelled response too, as vLLM ends it and as the openai SDK's ``responses.stream()`` helper
needs) or, when a model call fails, ``response.failed``). ``background: true`` answers at
once (status ``queued``) and generates detached from the connection; ``cancel`` aborts it (its
slot is free before the next step). Stored responses live in ``responses_store``. Status:
``completed`` (end of sequence), ``incomplete`` (``max_output_tokens``), ``cancelled``
(cancelled, or ended early by the server), ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api import generation, reply_bounds, tools
from app.api.adapters.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    NamedChoice,
    ResponsesRequest,
)
from app.api.adapters.responses_store import ResponseStore, Stored
from app.api.deps import KeyNameDep, ServingDep
from app.api.errors import (
    ERROR_RESPONSES,
    RETRY_AFTER,
    APIError,
    InvalidField,
    NotFound,
    Overloaded,
    ServerFault,
    documented,
    log,
)
from app.api.logprobs import TokenText, chat_content
from app.api.schemas import CalledFunction, ChatMessage, MessageToolCall, joined_text
from app.api.streaming import sse_event
from app.api.tools import ToolPlan
from app.serving import Serving
from app.structured.constraint import Constraint
from app.structured.tools import ToolCall, ToolSpec

router = APIRouter(prefix="/v1", tags=["openai"])


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
    previous = _previous(body, store, key_name)
    plan = tool_plan(body, serving)
    constraint, param = output_constraint(body, plan)
    messages, calls = conversation(body, previous)
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    internal = generation.InternalRequest(
        prompt=tools.chat_prompt(system + messages, plan, serving),
        max_tokens=body.max_output_tokens, sampling=body.sampling(), priority=body.priority,
        user=body.user, model=body.model, stream=bool(body.stream), id_prefix="resp",
        constraint=constraint, constraint_param=param, tools=plan,
    )  # fmt: skip
    ask = reply_bounds.LogprobAsk(1, body.logprobs_asked(), None,
                                    ("top_logprobs", "max_output_tokens", "include"))  # fmt: skip
    reply_bounds.check(serving, [len(internal.prompt)], internal.max_tokens, ask)
    await serving.precompile(internal.constraint, internal.constraint_param)  # off the loop
    run = generation.start(request, serving, internal, key_name)
    shape = ResponseShape(run, body, serving)
    entry = Stored(run.id, shape.object("queued"), messages, calls, bool(body.background), key_name)
    response: Response
    if body.background:
        store.put(entry)
        entry.task = asyncio.create_task(_background(run, serving, shape, entry, store))
        response = JSONResponse(entry.response)
    elif body.stream:
        keep: Keep = _keeper(store, entry) if body.store else lambda final, outcome: None
        if body.store:
            entry.response = shape.object("in_progress")
            store.put(entry)  # GET sees it while it streams
        response = generation.stream_response(run, serving, ResponseEvents(shape, keep))
    else:
        outcome = (await generation.whole_reply(request, run, serving))[0]
        entry.response = shape.finished(outcome)
        response = reply_bounds.json_reply(entry.response, serving, "max_output_tokens or "
                                           "top_logprobs")  # fmt: skip
        if body.store:
            _keeper(store, entry)(entry.response, outcome)
    return generation.flag_priority(response, serving, internal)


@router.get("/responses/{response_id}", responses=documented((NotFound, "unknown response")))
async def retrieve(response_id: str, request: Request, key_name: KeyNameDep) -> dict[str, Any]:
    """A stored response as last reported (a background one: its status now); another API
    key's response is a 404, as an unknown one."""
    return _stored(response_store(request), response_id, key_name).response


@router.post("/responses/{response_id}/cancel", responses=ERROR_RESPONSES)
async def cancel(
    response_id: str, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> dict[str, Any]:
    """Cancel a background response: it ends ``cancelled`` and its slot is free before the
    next step. Cancelling it again answers the same; a response that was not created in the
    background, or that has already finished otherwise, is a 400 (as vLLM answers); another
    API key's response is a 404, as an unknown one."""
    entry = _stored(response_store(request), response_id, key_name)
    if not entry.background:
        raise InvalidField("Cannot cancel a synchronous response.", param="response_id",
                           code="not_cancellable")  # fmt: skip
    if entry.status == "cancelled":
        return entry.response
    if not entry.running:
        raise InvalidField(f"Cannot cancel a response that is already {entry.status}.",
                           param="response_id", code="not_cancellable")  # fmt: skip
    entry.cancelled = True
    await serving.ranks.cancel(entry.id)
    if entry.task is not None:
        with contextlib.suppress(BaseException):  # its entry says how it ended
            await asyncio.shield(entry.task)
    return entry.response


def _check_options(body: ResponsesRequest, store: ResponseStore) -> None:
    """400 for what this server does not do: built-in tools (named), a background response
    that is not stored or is streamed."""
    for index, tool in enumerate(body.tools):
        if tool.type != "function":
            raise InvalidField(f"tool type {tool.type!r} is not supported: this server runs "
                               "no built-in tools (web search, file search, code interpreter, ...)",
                               param=f"tools.{index}.type", code="unsupported_tool")  # fmt: skip
        if tool.name is None:
            raise InvalidField("a function tool needs a name", param=f"tools.{index}.name",
                               code="missing")  # fmt: skip
    if body.background and (not body.store or not store.enabled):
        raise _unsupported("background", "background responses must be stored (store: true, "
                           "and the server's --responses-store-size above 0)")  # fmt: skip
    if body.background and store.running_background() >= store.size:
        raise Overloaded(f"{store.size} background responses are running (the store's "
                         "--responses-store-size); retry when one has finished",
                         param="background", code="too_many_background_responses",
                         headers={"Retry-After": RETRY_AFTER})  # fmt: skip
    if body.background and body.stream:
        raise _unsupported("stream", "a background response cannot be streamed here; poll it "
                           "with GET /v1/responses/{id}")  # fmt: skip


def tool_plan(body: ResponsesRequest, serving: Serving) -> ToolPlan | None:
    """The function tools offered and the choice (None: none offered); 400 for a choice that
    names no offered tool, or that needs tools when there are none."""
    specs = [ToolSpec(t.name or "", t.description or "", t.parameters or {"type": "object"})
             for t in body.tools]  # fmt: skip
    field = body.tool_choice
    choice, name = ("function", field.name) if isinstance(field, NamedChoice) else (field, None)
    # a mock decides whether to call under auto, unless the text has a format to follow
    return tools.plan_tools(specs, choice, name, body.parallel_tool_calls is not False, serving,
                            name_param="tool_choice.name",
                            decide=text_constraint(body) is None)  # fmt: skip


def output_constraint(
    body: ResponsesRequest, plan: ToolPlan | None
) -> tuple[Constraint | None, str]:
    """The grammar the output follows: a forced tool call's, or ``text.format``'s (not both:
    400), and the field that set it."""
    text = text_constraint(body)
    forced = tools.forced_constraint(plan, {"text.format": text is not None})
    return forced or (text, "text.format.schema")


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
        raise InvalidField("text.format.schema is required with type json_schema",
                           param="text.format.schema", code="missing")  # fmt: skip
    return Constraint.json_schema(fmt.schema_)


def _unsupported(param: str, message: str) -> APIError:
    return InvalidField(message, param=param, code="unsupported_parameter")


def _previous(body: ResponsesRequest, store: ResponseStore, owner: str | None) -> Stored | None:
    if body.previous_response_id is None:
        return None
    entry = _stored(store, body.previous_response_id, owner, param="previous_response_id")
    if entry.running:
        raise InvalidField(f"previous response {entry.id!r} is still {entry.status}",
                           param="previous_response_id",
                           code="previous_response_running")  # fmt: skip
    if entry.status == "failed":
        raise InvalidField(f"previous response {entry.id!r} failed: it has no answer to "
                           "continue from", param="previous_response_id",
                           code="previous_response_failed")  # fmt: skip
    return entry


def _stored(
    store: ResponseStore, response_id: str, owner: str | None, param: str = "response_id"
) -> Stored:
    """The entry ``response_id`` of the API key ``owner`` (None: no keys); else 404, the same
    answer for an unknown, expired or another key's response."""
    entry = store.get(response_id, owner)
    if entry is None:
        raise NotFound(f"no stored response with id {response_id!r} (responses are kept "
                       "in memory, bounded in count, bytes and age, and lost on restart)",
                       param=param, code="response_not_found")  # fmt: skip
    return entry


def conversation(
    body: ResponsesRequest, previous: Stored | None
) -> tuple[list[ChatMessage], set[str]]:
    """The previous response's conversation (if any) followed by this input, as chat
    messages, and the function call ids seen; a ``function_call_output`` must answer one
    (400)."""
    messages = list(previous.messages) if previous is not None else []
    calls = set(previous.calls) if previous is not None else set()
    for index, item in enumerate(body.items()):
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            _add_call(messages, ToolCall(item.name, item.arguments, item.call_id))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise InvalidField(f"function_call_output's call_id {item.call_id!r} answers "
                                   "no function_call item before it",
                                   param=f"input.{index}.call_id",
                                   code="unmatched_function_call_output")  # fmt: skip
            messages.append(ChatMessage(role="tool", content=joined_text(item.output),
                                        tool_call_id=item.call_id))  # fmt: skip
        else:
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=joined_text(item.content)))
    return messages, calls


def _add_call(messages: list[ChatMessage], call: ToolCall) -> None:
    """An assistant's call, joined to the assistant message just before it if there is one."""
    function = CalledFunction(name=call.name, arguments=call.arguments)
    entry = MessageToolCall(id=call.id, function=function)
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), entry]})
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[entry]))


Keep = Callable[[dict[str, Any], generation.Outcome | None], None]


def _keeper(store: ResponseStore, entry: Stored) -> Keep:
    """Stores ``entry`` once it is finished: its object, and its output in the conversation
    (None: it failed)."""

    def keep(final: dict[str, Any], outcome: generation.Outcome | None) -> None:
        entry.response = final
        if outcome is not None:
            entry.messages = [*entry.messages, ChatMessage(role="assistant", content=outcome.text)]
            for call in outcome.calls:
                _add_call(entry.messages, call)
                entry.calls.add(call.id)
        store.finished(entry)
        store.put(entry)

    return keep


async def _background(
    run: generation.Run, serving: Serving, shape: ResponseShape, entry: Stored,
    store: ResponseStore,
) -> None:  # fmt: skip
    """Generate a background response, detached from its connection, into its entry. It
    always ends: a failed model call (or a bug here, logged) leaves it ``failed``, and an
    unfinished request is aborted."""
    entry.response = shape.object("in_progress")
    try:
        outcome = (await generation.collect(run, serving))[0]
    except Exception as err:
        if isinstance(err, generation.ModelFailed):
            entry.response = shape.failed(err.error)
        else:
            log.exception("background response %s failed", run.id)
            entry.response = shape.failed(ServerFault(str(err)))
        store.finished(entry)
        return
    except BaseException:  # cancelled (shutdown): it still ends
        entry.response = shape.object("cancelled")
        store.finished(entry)
        raise
    finally:
        if run.stream.view.finish_reason is None:  # cancelled from outside (shutdown)
            serving.abort(run.id)
    cancelled = entry.cancelled and outcome.finish_reason == "abort"
    final = shape.finished(outcome, "cancelled" if cancelled else None)
    _keeper(store, entry)(final, outcome)


class ResponseShape:
    """The ``response`` object of one request, at any status."""

    def __init__(self, run: generation.Run, body: ResponsesRequest, serving: Serving) -> None:
        self.run, self.body, self.model = run, body, run.model  # a LoRA adapter is echoed
        self.top = body.logprobs_asked()  # None: no log probabilities
        self.token_text = TokenText(serving.tokenizer)
        self.id = run.id
        self.message_id = f"msg-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def object(
        self, status: str, output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None, **extra: Any,
    ) -> dict[str, Any]:  # fmt: skip
        body = self.body
        fmt = body.text.format.echo() if body.text and body.text.format else None
        named = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedChoice) else None
        # as vLLM: ``text`` and ``metadata`` echo the request (null when not sent), no ``store``
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": bool(body.background), "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model, "output": output or [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            # vLLM's echo of the sampling it applied: 1.0 and 0.0 when unset, no tools: "none"
            "temperature": body.temperature, "top_p": 1.0 if body.top_p is None else body.top_p,
            "presence_penalty": body.presence_penalty or 0.0,
            "frequency_penalty": body.frequency_penalty or 0.0, "service_tier": "auto",
            "tool_choice": named or body.tool_choice or ("auto" if body.tools else "none"),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools],
            "text": None if body.text is None else {"format": fmt}, "truncation": "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata, "top_logprobs": self.top,
        } | extra  # fmt: skip

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text, self.part_logprobs())]
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}  # fmt: skip

    @staticmethod
    def part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def part_logprobs(self) -> list[dict[str, Any]] | None:
        """A finished text part's log probabilities: null when not asked for, as vLLM (its
        stream's deltas, ``output_text.done`` and the opening part carry ``[]``)."""
        return None if self.top is None else self.logprobs()

    def logprobs(self, start: int = 0) -> list[dict[str, Any]]:
        """The output tokens' log probabilities from token ``start`` on (chat's shape: token,
        logprob, bytes, top_logprobs); [] when not asked for."""
        if self.top is None:
            return []
        choice = self.run.choices[0]
        entries = choice.logprobs or []
        return chat_content(choice.tokens[start:], entries[start:], self.token_text, self.top)

    @staticmethod
    def call(call: ToolCall, arguments: str | None, status: str) -> dict[str, Any]:
        """A ``function_call`` output item (``arguments`` None: the call's own)."""
        return {"type": "function_call", "id": f"fc-{call.id}", "call_id": call.id,
                "name": call.name, "status": status,
                "arguments": call.arguments if arguments is None else arguments}  # fmt: skip

    def finished(self, outcome: generation.Outcome, status: str | None = None) -> dict[str, Any]:
        """The object of a finished response (``status`` overrides the one ``outcome`` gives):
        a message item (unless the reply is only tool calls), then one item per call."""
        reason = outcome.finish_reason
        status = status or ("completed" if reason == "stop" else "incomplete")
        cut = {"length": "max_output_tokens", "abort": "cancelled"}
        incomplete = {"reason": cut[reason]} if status == "incomplete" and reason in cut else None
        item_status = _item_status(status)
        items = (
            [self.message(outcome.text, item_status)] if outcome.text or not outcome.calls else []
        )
        items += [self.call(call, None, item_status) for call in outcome.calls]
        return self.object(status, items, _usage(outcome), incomplete_details=incomplete)

    def failed(self, error: APIError) -> dict[str, Any]:
        """The ``failed`` object: ``error.code`` is ``server_error`` for our faults, else the
        client's problem (``invalid_grammar``: the grammar engine gave up on its grammar)."""
        code = "server_error" if error.server_fault else error.code or "invalid_request"
        return self.object("failed", error={"code": code, "message": error.message})


def _item_status(status: str) -> str:
    """An output item's status in a response of ``status``: ``completed`` once generation
    ended, even cut by ``max_output_tokens`` (as vLLM: the response's own status and
    ``incomplete_details`` say it was cut); ``incomplete`` in a cancelled response."""
    return "incomplete" if status == "cancelled" else "completed"


def _usage(outcome: generation.Outcome) -> dict[str, Any]:
    """Token usage in vLLM's shape: OpenAI's fields and vLLM's additions (cache writes, its
    built-in tools' output tokens and per-turn lists: 0 and empty, one turn without tools)."""
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": outcome.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [],
                                  "tool_output_tokens_per_turn": []},
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }  # fmt: skip


class ResponseEvents(generation.PartShaper):
    """OpenAI's typed Responses events for one response (an ``EventShaper``); ``keep`` gets
    the final object and the outcome (to store them). Without tools the message item opens at
    once; with tools, each output item (the message, then one per function call) opens when its
    first piece comes."""

    def __init__(self, shape: ResponseShape, keep: Keep) -> None:
        self.shape, self.keep = shape, keep
        self.sequence = 0
        self.index = 0  # the open (or next) output item's index
        self.said: list[str] | None = None  # the open message's text
        self.shown = 0  # output tokens whose log probabilities were sent
        self.kept = False  # the final object was handed to keep
        self.calling: tuple[ToolCall, list[str]] | None = None  # the open call, its arguments

    def _event(self, kind: str, /, **data: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence} | data
        self.sequence += 1
        return sse_event(kind, event)

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.shape.message_id, "output_index": self.index, "content_index": 0}

    def opening(self) -> Iterable[bytes]:
        shape = self.shape
        yield self._event("response.created", response=shape.object("in_progress"))
        yield self._event("response.in_progress", response=shape.object("in_progress"))
        if shape.run.plan is None:
            yield from self._open_message()

    def _open_message(self) -> Iterable[bytes]:
        yield from self._close("completed")
        self.said = []
        yield self._event("response.output_item.added", output_index=self.index,
                          item=self.shape.message(None, "in_progress"))  # fmt: skip
        yield self._event("response.content_part.added", **self._at(),
                          part=self.shape.part("", []))  # fmt: skip

    def _close(self, status: str) -> Iterable[bytes]:
        """Close the open item (if any): its done events, with ``status``."""
        shape = self.shape
        if self.said is not None:
            text, self.said = "".join(self.said), None
            logprobs = shape.logprobs()
            yield self._event("response.output_text.done", **self._at(), text=text,
                              logprobs=logprobs)  # fmt: skip
            yield self._event("response.content_part.done", **self._at(),
                              part=shape.part(text, shape.part_logprobs()))  # fmt: skip
            yield self._event("response.output_item.done", output_index=self.index,
                              item=shape.message(text, status))  # fmt: skip
            self.index += 1
        elif self.calling is not None:
            (call, pieces), self.calling = self.calling, None
            arguments, item_id = "".join(pieces), f"fc-{call.id}"
            yield self._event("response.function_call_arguments.done", item_id=item_id,
                              output_index=self.index, name=call.name,
                              arguments=arguments)  # fmt: skip
            yield self._event("response.output_item.done", output_index=self.index,
                              item=shape.call(call, arguments, status))  # fmt: skip
            self.index += 1

    def text(self, delta: str) -> Iterable[bytes]:
        if self.said is None:
            yield from self._open_message()
        assert self.said is not None
        self.said.append(delta)
        logprobs = self.shape.logprobs(self.shown)  # the tokens not sent yet
        self.shown = len(self.shape.run.choices[0].tokens)
        yield self._event("response.output_text.delta", **self._at(), delta=delta,
                          logprobs=logprobs)  # fmt: skip

    def call_start(self, index: int, call: ToolCall) -> Iterable[bytes]:
        yield from self._close("completed")
        self.calling = (call, [])
        yield self._event("response.output_item.added", output_index=self.index,
                          item=self.shape.call(call, "", "in_progress"))  # fmt: skip

    def call_arguments(self, index: int, delta: str) -> Iterable[bytes]:
        assert self.calling is not None
        call, pieces = self.calling
        pieces.append(delta)
        yield self._event("response.function_call_arguments.delta", item_id=f"fc-{call.id}",
                          output_index=self.index, delta=delta)  # fmt: skip

    def closing(self, outcome: generation.Outcome) -> Iterable[bytes]:
        final = self.shape.finished(outcome)
        if self.index == 0 and self.said is None and self.calling is None and not outcome.calls:
            yield from self._open_message()  # an empty reply: still one (empty) message
        yield from self._close(_item_status(final["status"]))
        self.keep(final, outcome)
        self.kept = True
        yield self._event("response.completed", response=final)  # its status says how it ended

    def failure(self, error: APIError) -> Iterable[bytes]:
        final = self.shape.failed(error)
        self.keep(final, None)
        self.kept = True
        yield self._event("response.failed", response=final)

    def closed(self) -> None:
        """The stream ended before its last event (the client left): stored as cancelled."""
        if not self.kept:
            self.kept = True
            self.keep(self.shape.object("cancelled"), None)
