"""Log probabilities in OpenAI's shapes (and vLLM's ``prompt_logprobs``), rendered from the
engine's ``Logprobs`` entries. A token's text and bytes come from its raw bytes (``TokenText``).

- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}], "refusal": null}``, ``top_logprobs`` holding the request's
  ``top_logprobs`` most likely tokens.
- Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, where each ``top_logprobs`` entry maps a token's text to its log-probability
  for the ``logprobs`` most likely tokens plus the chosen one (as vLLM does), and an echoed
  prompt's first token has ``null`` for both.
- ``prompt_logprobs`` (vLLM): one entry per prompt token, ``null`` for the first, else
  ``{token id: {"logprob", "decoded_token"}}`` for the prompt token and the most likely ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.models.protocol import Logprobs
from app.models.tokenizer import Tokenizer

_NEG_INF = -9999.0  # JSON has no -inf: a token the processors banned shows this (as vLLM)


def _value(logprob: float) -> float:
    return logprob if logprob > _NEG_INF else _NEG_INF


class TokenText:
    """Each token's text and raw bytes, computed once per response. A token's text is its bytes
    as UTF-8, or, when they are not whole characters (a multi-byte character split across
    tokens), ``bytes:`` followed by each byte as ``\\xNN`` (OpenAI's spelling); its ``bytes``
    are always the true bytes, so a client can join split characters back."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _entry(self, token: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token)
        if entry is None:
            raw = self.tokenizer.token_bytes(token)
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            entry = self._cache[token] = (text, list(raw))
        return entry

    def __call__(self, token: int) -> str:
        return self._entry(token)[0]

    def bytes(self, token: int) -> list[int]:
        return self._entry(token)[1]


def chat_content(
    tokens: Sequence[int], entries: Sequence[Logprobs | None], text: TokenText, top: int
) -> list[dict[str, Any]]:
    """The ``content`` list of a chat choice's ``logprobs`` for ``tokens``."""
    out: list[dict[str, Any]] = []
    for token, entry in zip(tokens, entries, strict=False):
        logprob = entry.logprob if entry is not None else 0.0
        alternatives = entry.top[:top] if entry is not None else ()
        out.append(
            _chat_token(text, token, logprob)
            | {"top_logprobs": [_chat_token(text, t, lp) for t, lp in alternatives]}
        )
    return out


def _chat_token(text: TokenText, token: int, logprob: float) -> dict[str, Any]:
    return {"token": text(token), "logprob": _value(logprob), "bytes": text.bytes(token)}


class CompletionLogprobs:
    """Builds the completions ``logprobs`` object piece by piece. A token's ``text_offset`` is
    the length of the text decoded from the tokens before it (a character split across tokens
    counts once, where it starts), starting at ``offset``, so offsets index the returned text."""

    def __init__(self, text: TokenText, top: int, offset: int = 0) -> None:
        self.text, self.top, self.offset = text, top, offset
        self._decoder = text.tokenizer.stream_decoder()

    def render(self, tokens: Sequence[int], entries: Sequence[Logprobs | None]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip
        for token, entry in zip(tokens, entries, strict=False):
            piece = self.text(token)
            out["tokens"].append(piece)
            out["text_offset"].append(self.offset)
            self.offset += len(self._decoder.feed((token,)))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for t, lp in entry.top[: self.top]:  # most likely first: a shared text keeps it
                top.setdefault(self.text(t), _value(lp))
            top.setdefault(piece, _value(entry.logprob))
            out["token_logprobs"].append(_value(entry.logprob))
            out["top_logprobs"].append(top)
        return out


def prompt_logprobs(
    prompt: Sequence[int], entries: Sequence[Logprobs | None] | None, text: TokenText
) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first token; the token and its alternatives."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for position, token in enumerate(prompt):
        entry = entries[position] if position < len(entries) else None
        if entry is None:
            out.append(None)
            continue
        found = {str(t): _prompt_entry(lp, rank, text(t)) for rank, (t, lp) in
                 enumerate(entry.top, start=1)}  # fmt: skip
        found.setdefault(str(token), _prompt_entry(entry.logprob, entry.rank, text(token)))
        out.append(found)
    return out


def _prompt_entry(logprob: float, rank: int | None, token: str) -> dict[str, Any]:
    """One token's entry: vLLM's ``rank`` is its place by probability (1: the most likely)."""
    return {"logprob": _value(logprob), "rank": rank, "decoded_token": token}
