"""A choice's tokens (and their log probabilities) released in step with its shown text.

The text of a reply is held back while it could still be the start of a stop string, and cut
right before the stop string (``StopStringMatcher``). Log probabilities must describe that text,
so a token is released only once its first character is shown: a token whose text starts before
the cut is kept (also one that straddles it: part of its text is shown, as vLLM keeps it); the
tokens wholly past the cut (the stop string's own) are dropped. A token that shows no text of its
own (the first bytes of a character split across tokens) starts where that character starts.
At the end without a stop string, every token is released.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.engine.stop_strings import StopStringMatcher
from app.models.protocol import Logprobs
from app.models.tokenizer import StreamDecoder

Entries = list[Logprobs | None]


class AlignedTokens:
    """Feeds one choice's tokens to its ``matcher`` one by one through ``decoder`` (a
    ``StreamDecoder`` itself: it counts the characters decoded) and releases them as above."""

    def __init__(self, decoder: StreamDecoder) -> None:
        self._decoder = decoder
        self._decoded = 0  # characters the decoder produced so far
        self._shown = 0  # characters of them shown (passed the matcher)
        self._pending: list[tuple[int, int, Logprobs | None]] = []  # (start, token, entry)

    def feed(self, ids: Sequence[int]) -> str:
        text = self._decoder.feed(ids)
        self._decoded += len(text)
        return text

    def flush(self) -> str:
        text = self._decoder.flush()
        self._decoded += len(text)
        return text

    def take(
        self,
        matcher: StopStringMatcher,
        tokens: Sequence[int],
        entries: Sequence[Logprobs | None] | None,
    ) -> str:
        """The text ``matcher`` shows for ``tokens``; tokens after a stop string are dropped."""
        text = ""
        for k, token in enumerate(tokens):
            if matcher.hit:
                break
            self._pending.append((self._decoded, token, entries[k] if entries else None))
            text += matcher.feed_tokens(self, [token])
        self.shown(text)
        return text

    def shown(self, text: str) -> None:
        """``text`` (given by the matcher outside ``take``, e.g. at the end) is shown."""
        self._shown += len(text)

    def release(self, everything: bool = False) -> tuple[list[int], Entries]:
        """The pending tokens whose text starts in the shown text (``everything``: all)."""
        count = len(self._pending)
        if not everything:
            count = next((i for i, p in enumerate(self._pending) if p[0] >= self._shown), count)
        out, self._pending = self._pending[:count], self._pending[count:]
        return [token for _, token, _ in out], [entry for _, _, entry in out]
