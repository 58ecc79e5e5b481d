"""Stop strings for the OpenAI routes: text is released only once it cannot be the start of a
stop string, so a streamed reply never shows part of one."""

from __future__ import annotations


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
