"""How the mocks honour a request's sampling parameters and report log probabilities.

The mocks' text is fixed by their language (``MockLanguage``), so parameters that only reshape a
distribution (temperature, top-k/top-p/min-p, penalties, a positive or mild logit bias) have no
effect on it. What forbids tokens is obeyed: the stop tokens while fewer than ``min_tokens``
tokens were generated, a ``logit_bias`` of -100 or less, ``bad_words`` and
``allowed_token_ids``. When the language's token is forbidden, the mock deterministically takes
the first allowed one of: a space, then the ids after the predicted one (wrapping around).

Log probabilities come from a synthetic distribution centred on the chosen token: it has
probability 1/2, the token ``i`` ids after it (modulo the vocabulary) probability 2**-(i+1).
So the chosen token is always the most likely, and every value is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq

from app.models.bans import bias_bans, rule_bans
from app.models.protocol import (
    NO_TOKEN,
    Logprobs,
    SampledRow,
    SamplingParams,
    StepResult,
    TokenHistory,
)

SPACE = ord(" ")
LN2 = math.log(2.0)
NextToken = Callable[[Seq[int]], int]


def choose(predicted: int, params: SamplingParams, history: TokenHistory, vocab: int) -> int:
    """``predicted``, or the first allowed token after it in the mock's fallback order."""
    if not params.constrains_choice:
        return predicted
    banned = bias_bans(params).union(rule_bans(params, history))  # the allow-list aside
    allowed = params.allowed_token_ids

    def ok(token: int) -> bool:
        return token not in banned and (allowed is None or token in allowed)

    if ok(predicted):
        return predicted
    if vocab > SPACE and ok(SPACE):
        return SPACE
    for step in range(1, vocab):
        candidate = (predicted + step) % vocab
        if ok(candidate):
            return candidate
    return NO_TOKEN  # everything is forbidden: the engine fails this request alone


def synthetic(chosen: int, token: int, top: int, vocab: int) -> Logprobs:
    """``token``'s log-probability under the distribution centred on ``chosen``, with the
    ``top`` most likely tokens of that distribution."""
    rank = (token - chosen) % vocab
    alternatives = tuple(((chosen + i) % vocab, -(i + 1) * LN2) for i in range(min(top, vocab)))
    return Logprobs(token, -(rank + 1) * LN2, alternatives, rank + 1)


def pick(
    predicted: int, params: SamplingParams, history: TokenHistory | None, vocab: int
) -> tuple[int, Logprobs | None]:
    """The token ``choose`` makes of ``predicted`` (``predicted`` itself without a ``history``)
    and, if ``params`` asks for log probabilities, its entry (``synthetic``)."""
    token = predicted if history is None else choose(predicted, params, history, vocab)
    top = params.logprobs
    return token, None if top is None else synthetic(token, token, top, vocab)


def prompt_logprobs(
    next_token: NextToken, tokens: Seq[int], first: int, end: int, top: int, vocab: int
) -> list[Logprobs]:
    """The log-probabilities of ``tokens[first:end]``, each given the tokens before it (the
    language's prediction there is the distribution's centre)."""
    return [
        synthetic(next_token(tokens[:position]), tokens[position], top, vocab)
        for position in range(max(first, 1), end)
    ]


def sample_rows(next_token: NextToken, rows: Seq[SampledRow], vocab: int) -> StepResult:
    """The stateless mock's ``next_tokens_for``: each row's token, chosen and reported."""
    picked: list[tuple[int, Logprobs | None]] = []
    prompts: dict[str, tuple[int, list[Logprobs]]] = {}
    for row in rows:
        params, prefix = row.sampling, row.tokens
        picked.append(pick(next_token(prefix), params, row, vocab))
        if params.prompt_logprobs is not None and len(prefix) == row.prompt_len:
            entries = prompt_logprobs(
                next_token, prefix, 1, row.prompt_len, params.prompt_logprobs, vocab
            )
            prompts[row.request_id] = (1, entries)
    return StepResult([t for t, _ in picked], [entry for _, entry in picked], prompts or None)
