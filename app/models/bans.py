"""The one definition of which tokens a request forbids, shared by the real model's logits
processors (``app.models.hf.logits_processors``), the mocks (``app.models.mock_sampling``) and
the request check that refuses a request forbidding every token (``forbids_everything``).

A request forbids: a token with a ``logit_bias`` of -100 or less (``BAN_BIAS``; the real model
adds the bias, the mocks treat it as a ban), its stop tokens while fewer than ``min_tokens``
tokens were generated, the last token of each ``bad_words`` sequence whose other tokens end the
output; and, with ``allowed_token_ids``, every token outside that list.
"""

from __future__ import annotations

from collections.abc import Collection

from app.models.protocol import BAN_BIAS, SamplingParams, TokenHistory


def rule_bans(params: SamplingParams, history: TokenHistory | None) -> list[int]:
    """The tokens ``params`` forbids after ``history`` by rule (the ``min_tokens`` stop ban,
    bad words); without a history, only the one-token bad words."""
    if history is None:
        return [word[0] for word in params.bad_words if len(word) == 1]
    tokens, generated = history.tokens, len(history.tokens) - history.prompt_len
    out = list(history.stop_token_ids) if generated < params.min_tokens else []
    for word in params.bad_words:
        head = len(word) - 1
        if head == 0 or (generated >= head and list(word[:head]) == tokens[len(tokens) - head :]):
            out.append(word[-1])
    return out


def bias_bans(params: SamplingParams) -> set[int]:
    """The tokens whose ``logit_bias`` is -100 or less."""
    return {token for token, bias in params.logit_bias if bias <= BAN_BIAS}


def forbids_everything(
    params: SamplingParams, stop_token_ids: Collection[int], vocab: int
) -> str | None:
    """The request field to blame when ``params`` leaves no token to sample at some step
    whatever the output (bias bans and one-token bad words against the allow-list, or, with
    ``min_tokens``, nothing left but stop tokens); None when a token is always left. A ban that
    depends on the output (a longer bad word) can still empty a row: the model then fails that
    request alone (``NO_TOKEN``)."""
    static = bias_bans(params) | set(rule_bans(params, None))
    if params.allowed_token_ids is not None:
        left, blame = set(params.allowed_token_ids) - static, "allowed_token_ids"
    elif len(static) + len(stop_token_ids) < vocab:
        return None  # fewer bans than tokens: one is always left
    else:
        left, blame = set(range(vocab)) - static, "logit_bias"
    if not left:
        return blame
    if params.min_tokens > 0 and not left - set(stop_token_ids):
        return "min_tokens"
    return None
