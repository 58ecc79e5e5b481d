"""Tool calling on every protocol: the tools offered and the choice as a ``ToolPlan``
(``plan_tools``: one checker, 400s naming the field; ``tool_plan`` reads chat's fields, whose
schemas are in ``app.api.schemas``), the tool messages' checks, the prompt (the chat template's
own tool rendering when it has one; else, as ``--tool-prompt-fallback`` says, the messages as
they are, as vLLM, or the default format of app/structured/tools.py), and
chat's ``tool_calls`` entries (``call_json``). Calls are read back by ``app.api.tool_reader``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.api.errors import APIError, InvalidField
from app.api.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice, ToolDef
from app.structured.tools import (
    ToolCall,
    ToolChoice,
    ToolMode,
    ToolSpec,
    call_constraint,
    loaded_arguments,
    render_call,
    render_result,
    tools_prompt,
)

if TYPE_CHECKING:
    from app.serving import Serving
    from app.structured.constraint import Constraint

ARGUMENT_FRAGMENT = 24  # characters per streamed argument fragment (when not streamed as made)


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


def tool_plan(
    body: ChatCompletionRequest, serving: Serving, decide: bool = True
) -> ToolPlan | None:
    """The chat request's tool plan (None: no tools offered), checked (``plan_tools``;
    ``decide`` as there, and off when a reply format governs the content: a mock then answers
    instead of calling)."""
    field = body.tool_choice
    choice, name = (
        ("function", field.function.name) if isinstance(field, NamedToolChoice) else (field, None)
    )
    parallel = body.parallel_tool_calls is not False
    tools = [_spec(tool) for tool in body.tools or []]
    formatted = any(formats_set(body).values())
    return plan_tools(tools, choice, name, parallel, serving, decide=decide and not formatted)


def formats_set(body: ChatCompletionRequest) -> dict[str, bool]:
    """Whether each of chat's reply-format fields asks for a format other than plain text."""
    values = {field: getattr(body, field) for field in ("response_format", "structured_outputs")}
    return {f: v is not None and getattr(v, "type", None) != "text" for f, v in values.items()}


def forced_constraint(
    plan: ToolPlan | None, formats: dict[str, bool]
) -> tuple[Constraint | None, str] | None:
    """The grammar of a ``required`` or named tool choice and its field (``tools``); None when
    the choice forces no call. 400 when one of ``formats`` (a reply-format field: whether it
    is set) is set too: the two cannot be combined."""
    constraint = plan.constraint() if plan is not None else None
    if constraint is None:
        return None
    for field, is_set in formats.items():
        if is_set:
            raise InvalidField(f"{field} cannot be combined with a tool_choice that forces a "
                               "tool call", param=field, code="invalid_request")  # fmt: skip
    return constraint, "tools"


# each protocol's tool choices (OpenAI's, Anthropic's) as modes
MODES = {"none": ToolMode.NONE, "auto": ToolMode.AUTO, "required": ToolMode.REQUIRED,
         "any": ToolMode.REQUIRED, "function": ToolMode.NAMED, "tool": ToolMode.NAMED}  # fmt: skip


def plan_tools(
    specs: list[ToolSpec],
    choice: str | None,
    name: str | None,
    parallel: bool,
    serving: Serving,
    *,
    name_param: str = "tool_choice",
    decide: bool = True,
) -> ToolPlan | None:
    """The tools offered and the choice, as every protocol reads them (None: no tools, or the
    choice ``none``). ``choice``: as the client spelt it (``MODES``; None: not given, ``auto``
    with tools, else none); ``name``: the function a named choice names. 400
    ``invalid_tool_choice`` for a named choice that names no offered tool (``name_param``), or a
    choice that needs tools when none are offered. ``decide``: a mock decides now whether it
    calls a tool under ``auto`` (False: a reply format governs the content, or the prompt is
    only counted)."""
    mode = MODES[choice] if choice is not None else ToolMode.AUTO if specs else ToolMode.NONE
    if mode is ToolMode.NAMED and name not in {spec.name for spec in specs}:
        offered = ", ".join(spec.name for spec in specs) or "none"
        message = f"tool_choice names {name!r}, which is not in tools (offered: {offered})"
        raise InvalidField(message, param=name_param, code="invalid_tool_choice")
    if mode is ToolMode.NONE:
        return None
    if not specs:
        raise InvalidField(f"tool_choice {choice!r} needs tools", param="tool_choice",
                           code="invalid_tool_choice")  # fmt: skip
    if mode is ToolMode.AUTO and decide and serving.mock_calls_tool():
        mode = ToolMode.REQUIRED
    return ToolPlan(specs, ToolChoice(mode, name if mode is ToolMode.NAMED else None), parallel)


def _spec(tool: ToolDef) -> ToolSpec:
    function = tool.function
    parameters = function.parameters if function.parameters is not None else {"type": "object"}
    return ToolSpec(function.name, function.description or "", parameters)


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
    return InvalidField(message, param=param, code="invalid_tool_message")


def chat_prompt(messages: list[ChatMessage], plan: ToolPlan | None, serving: Serving) -> list[int]:
    """The prompt's token ids. A template that renders tools gets the messages and the tools.
    One that cannot (``supports_tools`` false): with ``--tool-prompt-fallback none`` (the
    default, vLLM's answer) it gets each turn's role and text: the model is told of no tools,
    an assistant's calls are not shown, a result is a ``tool`` turn's content; with
    ``describe``, the default format (tools in a system message, calls and results as text)."""
    check_tool_messages(messages)
    tokenizer = serving.tokenizer
    has_tools = plan is not None or any(m.tool_calls or m.role == "tool" for m in messages)
    if has_tools and getattr(tokenizer, "supports_tools", False):
        tools = [tool.as_openai() for tool in plan.tools] if plan is not None else []
        dicts = [_template_message(m) for m in messages]
        ids: list[int] = tokenizer.chat_prompt_with_tools(dicts, tools)  # type: ignore[attr-defined]
        return ids
    if serving.settings.tool_prompt_fallback == "none":
        return tokenizer.chat_prompt([(m.template_role(), m.text()) for m in messages])
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
            {"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": loaded_arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]  # fmt: skip
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


# --- the reply --------------------------------------------------------------------------------


def call_json(index: int, call: ToolCall, with_arguments: bool = True) -> dict[str, Any]:
    """A chat ``tool_calls`` entry; without ``with_arguments``, a stream's first chunk of the
    call: its id and name only, the arguments following in later chunks (as vLLM sends it)."""
    function = {"name": call.name} | ({"arguments": call.arguments} if with_arguments else {})
    return {"index": index, "id": call.id, "type": "function", "function": function}
