"""Tool calling in the OpenAI chat API: the request fields (``tools``, ``tool_choice``,
``parallel_tool_calls``, assistant ``tool_calls`` and ``tool`` messages), their checks (400s
naming the field), the prompt (the chat template's own tool rendering when it has one, else the
default format of app/structured/tools.py), and the reply: ``message.tool_calls`` with
``finish_reason: "tool_calls"``, or streamed as OpenAI streams them (per call an ``index``, an
``id`` and the function's name, then argument fragments)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from app.api.errors import APIError
from app.structured.tools import (
    OPEN,
    ToolCall,
    ToolChoice,
    ToolMode,
    ToolSpec,
    call_constraint,
    parse_calls,
    render_call,
    render_result,
    tools_prompt,
)

if TYPE_CHECKING:
    from app.api.schemas import ChatCompletionRequest, ChatMessage
    from app.serving import Serving
    from app.structured.constraint import Constraint

# a tool's name, wherever a client sends one that is rendered into the prompt (a tool, an
# earlier call), on every protocol: OpenAI's pattern, so no name can close a tool-call block
FunctionName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
ARGUMENT_FRAGMENT = 24  # characters per streamed argument fragment (when not streamed as made)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: FunctionName  # rendered into the prompt, as a tool's name is
    arguments: StrictStr


class MessageToolCall(BaseModel):
    """An earlier assistant message's call, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")

    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoiceField = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request does with tools: ``choice`` is the effective one (a mock that decides
    to call under ``auto`` turns it into ``required``)."""

    tools: list[ToolSpec]
    choice: ToolChoice
    parallel: bool

    def constraint(self) -> Constraint | None:
        return call_constraint(self.tools, self.choice, self.parallel)

    @property
    def offered(self) -> frozenset[str]:
        return frozenset(tool.name for tool in self.tools)


def tool_plan(body: ChatCompletionRequest, serving: Serving) -> ToolPlan | None:
    """The request's tool plan (None: no tools offered), checked; 400 for a bad choice."""
    tools = [_spec(tool) for tool in body.tools or []]
    choice = _choice(body.tool_choice, tools)
    if choice.mode is ToolMode.NONE:
        return None
    formatted = any(
        value is not None and getattr(value, "type", None) != "text"
        for value in (body.response_format, body.structured_outputs)
    )  # a reply format governs the content: a mock then answers instead of calling
    if choice.mode is ToolMode.AUTO and not formatted and serving.mock_calls_tool():
        choice = ToolChoice(ToolMode.REQUIRED)
    parallel = body.parallel_tool_calls is not False
    return ToolPlan(tools, choice, parallel)


def _spec(tool: ToolDef) -> ToolSpec:
    function = tool.function
    parameters = function.parameters if function.parameters is not None else {"type": "object"}
    return ToolSpec(function.name, function.description or "", parameters)


def _choice(field: ToolChoiceField | None, tools: list[ToolSpec]) -> ToolChoice:
    if field is None:
        return ToolChoice(ToolMode.AUTO if tools else ToolMode.NONE)
    if isinstance(field, NamedToolChoice):
        name = field.function.name
        if name not in {tool.name for tool in tools}:
            offered = ", ".join(tool.name for tool in tools) or "none"
            message = f"tool_choice names {name!r}, which is not in tools (offered: {offered})"
            raise APIError(400, message, param="tool_choice", code="invalid_tool_choice")
        return ToolChoice(ToolMode.NAMED, name)
    if field != "none" and not tools:
        raise APIError(400, f"tool_choice {field!r} needs tools", param="tool_choice",
                       code="invalid_tool_choice")  # fmt: skip
    return ToolChoice(ToolMode(field))


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """A ``tool`` message answers a call of an earlier assistant message (400 otherwise)."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            bad = f"messages.{index}.tool_calls"
            raise _bad_message("only assistant messages carry tool_calls", bad)
        called.update(call.id for call in message.tool_calls or [])
        if message.role != "tool":
            continue
        bad = f"messages.{index}.tool_call_id"
        if message.tool_call_id is None:
            raise _bad_message("a tool message needs tool_call_id", bad)
        if message.tool_call_id not in called:
            message_text = f"tool_call_id {message.tool_call_id!r} answers no earlier tool call"
            raise _bad_message(message_text, bad)


def _bad_message(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_tool_message")


def chat_prompt(messages: list[ChatMessage], plan: ToolPlan | None, serving: Serving) -> list[int]:
    """The prompt's token ids: the template's own tool rendering when it has one, else the
    default format (tools in a system message, calls and results as text)."""
    check_tool_messages(messages)
    tokenizer = serving.tokenizer
    has_tools = plan is not None or any(m.tool_calls or m.role == "tool" for m in messages)
    if has_tools and getattr(tokenizer, "supports_tools", False):
        tools = [tool.as_openai() for tool in plan.tools] if plan is not None else []
        dicts = [_template_message(m) for m in messages]
        ids: list[int] = tokenizer.chat_prompt_with_tools(dicts, tools)  # type: ignore[attr-defined]
        return ids
    pairs = [(m.template_role(), _default_text(m)) for m in messages]
    if plan is not None:
        offer = tools_prompt(plan.tools, plan.choice)
        if pairs and pairs[0][0] == "system":
            pairs[0] = ("system", pairs[0][1] + "\n\n" + offer)
        else:
            pairs.insert(0, ("system", offer))
    return tokenizer.chat_prompt(pairs)


def _default_text(message: ChatMessage) -> str:
    if message.role == "tool":
        return render_result(message.text())
    calls = [render_call(ToolCall(c.function.name, c.function.arguments, c.id))
             for c in message.tool_calls or []]  # fmt: skip
    return "\n".join([message.text(), *calls]) if message.text() else "\n".join(calls)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.template_role(), "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _loaded(c.function.arguments)}}
            for c in message.tool_calls
        ]  # fmt: skip
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _loaded(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# --- the reply --------------------------------------------------------------------------------


def call_json(index: int, call: ToolCall, with_arguments: bool = True) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments if with_arguments else ""}
    return {"index": index, "id": call.id, "type": "function", "function": function}


def whole_message(
    text: str, reason: str | None, plan: ToolPlan
) -> tuple[dict[str, Any], str | None]:
    """The non-streamed ``message`` and finish reason of a reply that may call tools."""
    if reason == "stop":
        content, calls = parse_calls(text, plan.choice, plan.offered, plan.parallel)
        if calls:
            listed = [call_json(i, c) for i, c in enumerate(calls)]
            for entry in listed:
                entry.pop("index")  # a whole message's calls have no index
            named = plan.choice.mode is ToolMode.NAMED  # OpenAI: "stop" for a named function
            message = {"role": "assistant", "content": content, "tool_calls": listed}
            return message, "stop" if named else "tool_calls"
    return {"role": "assistant", "content": text}, reason


class ToolDeltas:
    """Turns a reply's (text, finish reason) pieces into chat ``delta`` objects. A named
    function streams its arguments as they are generated; ``required`` and ``auto`` hold the
    call text until the reply ends (``auto`` streams the content before a ``<tool_call>``
    block, holding back a possible start of one), then send each call's id and name, then its
    arguments in fragments."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""  # text not sent yet
        self.named: ToolCall | None = None
        self.calling = False  # auto: a <tool_call> block has started

    def feed(self, text: str, reason: str | None) -> list[tuple[dict[str, Any], str | None]]:
        mode = self.plan.choice.mode
        if mode is ToolMode.NAMED:
            return self._named(text, reason)
        self.held += text
        out: list[tuple[dict[str, Any], str | None]] = []
        if mode is ToolMode.AUTO and not self.calling:
            out += self._content_before_call()
        if reason is None:
            return out
        return out + self._end(reason)

    def _named(self, text: str, reason: str | None) -> list[tuple[dict[str, Any], str | None]]:
        out: list[tuple[dict[str, Any], str | None]] = []
        if self.named is None:
            self.named = ToolCall(self.plan.choice.name or "", "")
            out.append(({"tool_calls": [call_json(0, self.named, False)]}, None))
        if text:
            fragment = {"index": 0, "function": {"arguments": text}}
            out.append(({"tool_calls": [fragment]}, None))
        if reason is not None:
            out.append(({}, reason))  # a named function ends with "stop", as OpenAI's does
        return out

    def _content_before_call(self) -> list[tuple[dict[str, Any], str | None]]:
        start = self.held.find(OPEN)
        if start >= 0:
            self.calling = True
            sendable, self.held = self.held[:start], self.held[start:]
        else:
            keep = _partial_suffix(self.held, OPEN)
            sendable, self.held = (
                self.held[: len(self.held) - keep],
                self.held[len(self.held) - keep :],
            )
        return [({"content": sendable}, None)] if sendable else []

    def _end(self, reason: str) -> list[tuple[dict[str, Any], str | None]]:
        text, self.held = self.held, ""
        content, calls = (
            parse_calls(text, self.plan.choice, self.plan.offered, self.plan.parallel)
            if reason == "stop"
            else (text, [])
        )
        out: list[tuple[dict[str, Any], str | None]] = []
        if content:
            out.append(({"content": content}, None))
        for index, call in enumerate(calls):
            out.append(({"tool_calls": [call_json(index, call, False)]}, None))
            for at in range(0, len(call.arguments), ARGUMENT_FRAGMENT):
                piece = call.arguments[at : at + ARGUMENT_FRAGMENT]
                out.append(
                    ({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}, None)
                )
        out.append(({}, "tool_calls" if calls else reason))
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
