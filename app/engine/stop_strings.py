"""Stop strings. ``StopStringMatcher`` releases text only once it cannot be the start of a stop
string, so a streamed reply never shows part of one. ``StopStrings`` is the engine's stop
condition: it detokenizes a request's new tokens incrementally at every step and reports the
step whose tokens complete a stop string, so the request ends there whatever its reader's pace.
"""

from __future__ import annotations

from app.models.tokenizer import StreamDecoder


class StopStringMatcher:
    """Feed decoded text; get back the text safe to emit and whether a stop string was hit
    (``matched``: which one). After a hit, the emitted text ends right before the stop string.

    With ``min_tokens``, ``feed_tokens`` decodes the first ``min_tokens - 1`` tokens one by one
    and never searches their text, so a stop string can end the request only from its
    ``min_tokens``-th token on. The engine's stop condition and the API's text cut both use
    it, token by token, so they agree."""

    def __init__(self, stops: list[str], min_tokens: int = 0) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self._unsearched = max(min_tokens - 1, 0)  # tokens whose text is never searched
        self.hit = False
        self.matched: str | None = None  # the stop string hit (the earliest in the text)

    def feed_tokens(self, decoder: StreamDecoder, tokens: list[int]) -> str:
        """Decode ``tokens`` with ``decoder`` and ``feed`` the text (see ``min_tokens``)."""
        if not self._unsearched or not self.stops:
            return self.feed(decoder.feed(tokens))
        skipped = min(self._unsearched, len(tokens))
        self._unsearched -= skipped
        text = "".join(decoder.feed(tokens[i : i + 1]) for i in range(skipped))
        return text + (self.feed(decoder.feed(tokens[skipped:])) if skipped < len(tokens) else "")

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        if self.hit:
            return ""
        buffer = self._pending + text
        found = [(i, s) for s in self.stops if (i := buffer.find(s)) >= 0]
        cut = min(found)[0] if found else -1
        if cut >= 0:
            self.hit, self.matched = True, min(found)[1]
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

    def __init__(self, stops: list[str], decoder: StreamDecoder, min_tokens: int = 0) -> None:
        self._decoder = decoder
        self._matcher = StopStringMatcher(stops, min_tokens)

    def feed(self, tokens: list[int]) -> bool:
        self._matcher.feed_tokens(self._decoder, tokens)
        return self._matcher.hit
