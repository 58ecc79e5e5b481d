"""A conversation as the ``(role, text)`` turns a tokenizer's chat template takes, whichever
protocol it came in. Tool calls and their results, until the model's own tool template is wired
in, are written as text the model can read back: a call as ``<tool_call>{"name", "arguments"}
</tool_call>`` in the assistant's turn, a result as a ``tool`` turn."""

from __future__ import annotations

import contextlib
import json
from typing import Any

Turn = tuple[str, str]


def tool_call_text(name: str, arguments: Any) -> str:
    """A tool call as assistant text (``arguments``: a JSON value or its JSON text)."""
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else kept as the string the client sent
            arguments = json.loads(arguments)
    call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


def merge(turns: list[Turn]) -> list[Turn]:
    """Consecutive turns of one role joined into one (blocks of one message, or a call and its
    text), so the template sees one turn per speaker change."""
    merged: list[Turn] = []
    for role, text in turns:
        if merged and merged[-1][0] == role and role != "tool":
            merged[-1] = (role, merged[-1][1] + text)
        else:
            merged.append((role, text))
    return merged
