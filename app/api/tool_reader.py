"""Tool calls read from a reply, protocol-neutral, the same way on every route (the protocols
lay the parts out as their own events).

``read_calls`` reads a whole reply: ``app.structured.tools.parse_calls`` with the tools offered
(under ``auto`` a call to a tool not offered, or several calls with ``parallel_tool_calls:
false``, stay content). ``CallReader.feed(text, reason)`` turns each streamed text delta
into ``TextPiece``, ``CallStart`` and ``CallArguments`` parts: a named function's arguments
stream as they are generated (the reply is the arguments); under ``required`` the reply (a JSON
list of calls) is held until it ends; under ``auto`` the content before a ``<tool_call>`` block
streams (a possible start of one is held back), the rest is read at the end by
``read_calls``. After the last delta, ``content`` and ``calls`` are the reply's, consistent
with the parts sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.api.tools import ToolPlan
from app.structured.tools import OPEN, ToolCall, ToolMode, parse_calls


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    call: ToolCall  # its id and name (arguments follow as CallArguments)


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str


Part = TextPiece | CallStart | CallArguments


def read_calls(text: str, reason: str, plan: ToolPlan) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply; a reply that did not end on its own has no calls."""
    if reason != "stop":
        return text, []
    content, calls = parse_calls(text, plan.choice, plan.offered, plan.parallel)
    return content or "", calls


class CallReader:
    """Splits a streamed reply into text and tool-call parts (see the module)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""  # text not sent yet
        self.calling = False  # auto: a <tool_call> block has started
        self.named: ToolCall | None = None
        self.arguments: list[str] = []
        self.sent: list[str] = []  # content sent
        self.calls: list[ToolCall] = []

    @property
    def content(self) -> str:
        return "".join(self.sent)

    def feed(self, text: str, reason: str | None) -> list[Part]:
        mode = self.plan.choice.mode
        if mode is ToolMode.NAMED:
            return self._named(text, reason)
        self.held += text
        out: list[Part] = []
        if mode is ToolMode.AUTO and not self.calling:
            out += self._content_before_call()
        if reason is not None:
            out += self._end(reason)
        return out

    def _named(self, text: str, reason: str | None) -> list[Part]:
        out: list[Part] = []
        if self.named is None:
            self.named = ToolCall(self.plan.choice.name or "", "")
            out.append(CallStart(0, self.named))
        if text:
            self.arguments.append(text)
            out.append(CallArguments(0, text))
        if reason is not None:
            named = self.named
            self.calls = [ToolCall(named.name, "".join(self.arguments), named.id)]
        return out

    def _content_before_call(self) -> list[Part]:
        start = self.held.find(OPEN)
        if start >= 0:
            self.calling = True
        else:
            start = len(self.held) - _partial_suffix(self.held, OPEN)
        sendable, self.held = self.held[:start], self.held[start:]
        return self._text(sendable)

    def _end(self, reason: str) -> list[Part]:
        text, self.held = self.held, ""
        content, self.calls = read_calls(text, reason, self.plan)
        out = self._text(content)
        for index, call in enumerate(self.calls):
            out += [CallStart(index, call), CallArguments(index, call.arguments)]
        return out

    def _text(self, text: str) -> list[Part]:
        if not text:
            return []
        self.sent.append(text)
        return [TextPiece(text)]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
