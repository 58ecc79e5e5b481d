"""Tool calling, protocol-neutral: the tools a request offers, how the model is told about them
(when its chat template cannot say it), the constraint a tool choice implies, and the parser
that reads calls back from the generated text.

The default tool-call format (for templates without tool support, and what ``auto`` parses):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call (the Hermes/Qwen format). Under ``required`` (or ``auto`` when a mock decides
to call) the output is decoded under a JSON schema for a list of calls,
``[{"name": ..., "arguments": {...}}, ...]`` (one at most without ``parallel_tool_calls``); under
a named function it is that function's arguments object. Arguments therefore always parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from app.structured.constraint import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_NOT_JSON = object()  # what ``_json`` returns for text that does not parse


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function the model may call; ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """``parameters``, always an object (OpenAI reads ``{}`` as "no arguments")."""
        if self.parameters.get("type") == "object":
            return self.parameters
        if not self.parameters:
            return {"type": "object"}
        return {"allOf": [{"type": "object"}, self.parameters]}

    def as_openai(self) -> dict[str, Any]:
        function = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
        }
        return {"type": "function", "function": function}


class ToolMode(StrEnum):
    NONE = "none"  # tools are not offered to the model
    AUTO = "auto"  # the model decides; calls are parsed from its text
    REQUIRED = "required"  # at least one call, decoded under the calls' schema
    NAMED = "named"  # exactly one call of ``ToolChoice.name``, decoded under its parameters


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ToolMode = ToolMode.AUTO
    name: str | None = None  # with ``NAMED``


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made; ``arguments`` is JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def call_constraint(tools: list[ToolSpec], choice: ToolChoice, parallel: bool) -> Constraint | None:
    """The grammar a tool choice imposes (None: the text is free)."""
    if choice.mode is ToolMode.NAMED:
        tool = next(t for t in tools if t.name == choice.name)
        return Constraint.json_schema(tool.arguments_schema)
    if choice.mode is ToolMode.REQUIRED:
        return Constraint.json_schema(calls_schema(tools, parallel))
    return None


def calls_schema(tools: list[ToolSpec], parallel: bool) -> dict[str, Any]:
    """A JSON list of one call (more with ``parallel``) to any of ``tools``."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.arguments_schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_calls(
    text: str, choice: ToolChoice, offered: frozenset[str] | None = None, parallel: bool = True
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) read back from a finished reply. Under ``NAMED`` the text is the
    arguments; under ``REQUIRED`` a JSON list of calls; under ``AUTO`` the default format's
    blocks (the text around them is the content, None if empty). Text that does not parse, and
    under ``AUTO`` a call to a tool not ``offered`` or more than one call without
    ``parallel``, stays content with no calls."""
    if choice.mode is ToolMode.NAMED and choice.name is not None:
        return (None, [ToolCall(choice.name, text)]) if _json(text) is not _NOT_JSON else (text, [])
    if choice.mode is ToolMode.REQUIRED:
        calls = _calls_from_list(text)
        return (None, calls) if calls else (text, [])
    content, calls = _calls_from_blocks(text)
    unknown = offered is not None and any(call.name not in offered for call in calls)
    if unknown or (not parallel and len(calls) > 1):
        return text, []
    return content, calls


def _calls_from_list(text: str) -> list[ToolCall]:
    items = _json(text)
    if not isinstance(items, list):
        return []
    calls = [_call(item) for item in items]
    return [c for c in calls if c is not None] if all(calls) else []


def _calls_from_blocks(text: str) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    for block in _BLOCK.findall(text):
        call = _call(_json(block))
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls


def _call(item: object) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def _json(text: str) -> object:
    """``text``'s JSON value, or ``_NOT_JSON``."""
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON


def tools_prompt(tools: list[ToolSpec], choice: ToolChoice) -> str:
    """The system text that offers ``tools`` in the default format (for a chat template that
    cannot render tools, and for the mocks)."""
    listed = "\n".join(
        json.dumps(tool.as_openai()["function"], ensure_ascii=False) for tool in tools
    )
    text = (
        "You may call these tools:\n<tools>\n" + listed + "\n</tools>\n"
        "To call a tool, reply with one block per call:\n"
        f'{OPEN}\n{{"name": <tool name>, "arguments": <arguments object>}}\n{CLOSE}'
    )
    if choice.mode is ToolMode.NAMED:  # the grammar then forces the arguments object alone
        text += f"\nCall the tool {choice.name} now: reply with its arguments object only."
    elif choice.mode is ToolMode.REQUIRED:  # ... or a JSON list of calls
        text += (
            "\nCall at least one tool now: reply with a JSON list of calls, "
            '[{"name": <tool name>, "arguments": <arguments object>}, ...].'
        )
    return text


def loaded_arguments(arguments: str) -> object:
    """A call's JSON arguments as a value (text that is not JSON: as it is)."""
    value = _json(arguments)
    return arguments if value is _NOT_JSON else value


def render_call(call: ToolCall) -> str:
    """An earlier assistant call as the default format's text (for the conversation)."""
    arguments = loaded_arguments(call.arguments)
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def render_result(content: str) -> str:
    """A tool's result as the default format's text."""
    return f"<tool_response>\n{content}\n</tool_response>"
