"""Stop strings. ``StopStringMatcher`` releases text only once it cannot be the start of a stop
string, so a streamed reply never shows part of one. ``StopStrings`` is the engine's stop
condition: it detokenizes a request's new tokens incrementally at every step and reports the
step whose tokens complete a stop string, so the request ends there whatever its reader's pace.
"""

from __future__ import annotations

from app.models.tokenizer import StreamDecoder


class StopStringMatcher:
    """Feed decoded text; get back the text safe to emit and whether a stop string was hit.
    After a hit, the emitted text ends right before the stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        if self.hit:
            return ""
        buffer = self._pending + text
        cut = min((i for s in self.stops if (i := buffer.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            self._pending = ""
            return buffer[:cut]
        safe = len(buffer) - self._hold
        if safe <= 0:
            self._pending = buffer
            return ""
        self._pending = buffer[safe:]
        return buffer[:safe]

    def flush(self) -> str:
        """At the end of generation: release what was held back."""
        text, self._pending = ("" if self.hit else self._pending), ""
        return text


class StopStrings:
    """A ``StopCondition``: True from the step whose tokens complete one of ``stops``."""

    __slots__ = ("_decoder", "_matcher")

    def __init__(self, stops: list[str], decoder: StreamDecoder) -> None:
        self._decoder = decoder
        self._matcher = StopStringMatcher(stops)

    def feed(self, tokens: list[int]) -> bool:
        self._matcher.feed(self._decoder.feed(tokens))
        return self._matcher.hit
