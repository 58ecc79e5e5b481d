"""Bounds on the size of a request's reply: its log probabilities, checked before it is
admitted, and the bytes a whole (non-streamed) reply may hold in the server.

A request's log probabilities are the bulk of its reply and of what the engine keeps for it:
``n`` choices each carry an entry per token (the chosen token and ``top`` alternatives), and
prompt log probabilities are computed per choice (such choices do not share their prompt's
prefill). Two server-wide bounds (``app.config``), each a 400 naming the fields (never a 429:
the same request can never succeed):

- ``--max-logprob-entries``: the entries the reply would hold at most, counted as each route
  renders them (``LogprobAsk``), the output at its ``max_tokens`` (or the default);
- ``--max-prompt-logprob-tokens``: ``n`` x prompt tokens over every prompt, when prompt log
  probabilities are asked for.

With both unset they scale with the context (``defaults``): one full-context prompt scored as
lm-evaluation-harness scores it (``echo``, ``logprobs: 1``) costs about 4 x context entries, so
the defaults take eight at once.

``--max-response-bytes`` bounds what one request may leave buffered in the server: a whole
reply is rendered once (``json_reply``) and, past the bound, answered with a 400 naming what
to lower instead (a backstop: with the bounds above at their defaults a reply stays well under
it). A stream holds at most one event plus the connection's small send buffers
(``app.api.connection``), and a reader that stops taking them is cut off (``--send-timeout``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response

from app.api.errors import InvalidField
from app.config import Settings
from app.serving import Serving

ENTRIES_PER_CONTEXT = 32  # --max-logprob-entries unset: this many x --max-model-len
PROMPT_TOKENS_PER_CONTEXT = 8  # --max-prompt-logprob-tokens unset: this many x --max-model-len


@dataclass(frozen=True, slots=True)
class LogprobAsk:
    """What a request asks for, in the terms of the route that renders it.

    ``top``: alternatives per output token (None: no log probabilities); ``prompt_top``: per
    prompt token (None: none); ``echo``: completions' ``echo`` with ``logprobs`` (the prompt's
    tokens in each choice's ``logprobs`` as well); ``prompt_once``: chat renders the prompt's
    once, next to the choices (completions: once per choice); ``fields``: the request's names
    for these, most responsible first (the first is the error's ``param``)."""

    n: int
    top: int | None
    prompt_top: int | None
    fields: tuple[str, ...]
    echo: bool = False
    prompt_once: bool = False

    def entries(self, prompt: int, output: int) -> int:
        """Entries in the reply for one prompt of ``prompt`` tokens and its ``n`` choices of at
        most ``output`` tokens each."""
        per_choice = 0
        if self.top is not None:
            per_choice += (output + (prompt if self.echo else 0)) * (self.top + 1)
        prompt_entries = 0 if self.prompt_top is None else prompt * (self.prompt_top + 1)
        if self.prompt_once:
            return self.n * per_choice + prompt_entries
        return self.n * (per_choice + prompt_entries)


def defaults(settings: Settings) -> tuple[int, int]:
    """The two bounds in force: (entries, n x prompt tokens)."""
    context = settings.max_model_len
    entries = settings.max_logprob_entries or ENTRIES_PER_CONTEXT * context
    prompt = settings.max_prompt_logprob_tokens or PROMPT_TOKENS_PER_CONTEXT * context
    return entries, prompt


def check(
    serving: Serving, prompts: Sequence[int], max_tokens: int | None, ask: LogprobAsk
) -> None:
    """400 if a request with prompts of these lengths, ``max_tokens`` (None: the default) and
    ``ask`` passes either bound; nothing when it asks for no log probabilities."""
    if ask.top is None and ask.prompt_top is None:
        return
    max_entries, max_prompt = defaults(serving.settings)
    if ask.prompt_top is not None:
        tokens = ask.n * sum(prompts)
        if tokens > max_prompt:
            raise InvalidField(f"prompt log probabilities for n ({ask.n}) x {sum(prompts)} "
                               f"prompt tokens = {tokens} exceed this server's "
                               f"--max-prompt-logprob-tokens ({max_prompt}); lower n, or send "
                               "fewer or shorter prompts per request", param="prompt_logprobs",
                               code="too_many_logprobs")  # fmt: skip
    entries = sum(ask.entries(p, serving.output_tokens(p, max_tokens)) for p in prompts)
    if entries > max_entries:
        raise InvalidField(f"{', '.join(ask.fields)} ask for up to {entries} log-probability "
                           "entries (n x tokens x (1 + alternatives)), past this server's "
                           f"--max-logprob-entries ({max_entries}); lower one of them",
                           param=ask.fields[0], code="too_many_logprobs")  # fmt: skip


def json_reply(content: Any, serving: Serving, fields: str) -> Response:
    """``content`` as a JSON response (Starlette's ``JSONResponse`` encoding), or a 400
    ``response_too_large`` naming ``fields`` (what the client can lower) when its bytes pass
    ``--max-response-bytes``."""
    body = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    data = body.encode("utf-8")
    bound = int(serving.settings.max_response_bytes)
    if len(data) > bound:
        raise InvalidField(f"the reply ({len(data)} bytes) exceeds this server's "
                           f"--max-response-bytes ({bound}); lower {fields}, or stream it",
                           code="response_too_large")  # fmt: skip
    return Response(data, media_type="application/json")
