"""Logits processors for the real model: per-request penalties, biases and bans applied to the
float32 logits of the rows that sample in one step, before the sampler.

``process(logits, params, histories)`` changes, in place, only the rows whose
``SamplingParams.processes_logits`` is set; a step with none of them returns at once. Each kind
is one batched tensor operation over the rows that use it (rows are gathered, changed and
written back), in this order:

1. penalties (OpenAI's and vLLM's definitions): ``repetition_penalty`` r over every token seen
   in the prompt or the output (a positive logit divided by r, a negative one multiplied by
   it), then ``frequency_penalty`` x (count in the output) and ``presence_penalty`` x (seen in
   the output) subtracted;
2. ``logit_bias`` added;
3. bans (-inf): the request's stop tokens while fewer than ``min_tokens`` tokens were generated,
   the last token of each ``bad_words`` sequence whose other tokens end the output;
4. ``allowed_token_ids``: every other token -inf.

A row's token history (``TokenHistory``) is read where it lives (the engine's token list); the
penalties count it per step and touch only the entries it holds (O(tokens) per penalized row,
not O(vocabulary)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.models.bans import rule_bans
from app.models.protocol import SamplingParams, TokenHistory

Rows = list[tuple[int, SamplingParams, TokenHistory | None]]
# ``repetition_penalty`` is any finite value above 0 (vLLM's check); applied, it is held within
# [MIN_FACTOR, 1 / MIN_FACTOR] and a penalized logit within +-MAX_PENALIZED, so every logit
# stays finite, even divided by the lowest temperature the sampler divides by (1e-5)
MIN_FACTOR = 1e-20
MAX_PENALIZED = 1e30


def process(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
) -> None:
    """Apply every row's processors to ``logits`` (rows, vocab), in place."""
    rows: Rows = [
        (i, p, histories[i] if i < len(histories) else None)
        for i, p in enumerate(params)
        if p.processes_logits
    ]
    if not rows:
        return
    _penalties(logits, [r for r in rows if r[1].penalizes and r[2] is not None])
    _bias(logits, [r for r in rows if r[1].logit_bias])
    _bans(logits, [r for r in rows if r[1].min_tokens or r[1].bad_words])
    _allow(logits, [r for r in rows if r[1].allowed_token_ids is not None])


def _penalties(logits: torch.Tensor, rows: Rows) -> None:
    """Touches only the (row, token) entries a history holds: O(history), not O(vocabulary)."""
    if not rows:
        return
    device, vocab, dtype = logits.device, logits.shape[1], logits.dtype
    index = torch.tensor([i for i, _, _ in rows], device=device)
    seen_keys, out_keys = [], []
    for k, (_, _, history) in enumerate(rows):
        assert history is not None
        keys = torch.tensor(history.tokens, dtype=torch.long) + k * vocab
        seen_keys.append(keys)
        out_keys.append(keys[history.prompt_len :])
    seen = torch.unique(torch.cat(seen_keys)).to(device)
    output, counts = torch.unique(torch.cat(out_keys), return_counts=True)
    output, counts = output.to(device), counts.to(device=device, dtype=dtype)
    rep = _column([p.repetition_penalty for _, p, _ in rows], logits).squeeze(1)
    freq = _column([p.frequency_penalty for _, p, _ in rows], logits).squeeze(1)
    pres = _column([p.presence_penalty for _, p, _ in rows], logits).squeeze(1)
    sub = logits.index_select(0, index)
    flat = sub.view(-1)
    # a factor past float32's reach (1e-308 is 0 there, 1e308 inf) would make a logit inf or
    # NaN, and the draw then fails the whole step: every request in it, not just this one
    values, factor = flat[seen], rep[seen // vocab].clamp(MIN_FACTOR, 1 / MIN_FACTOR)
    penalized = torch.where(values > 0, values / factor, values * factor)
    flat[seen] = penalized.clamp(-MAX_PENALIZED, MAX_PENALIZED)
    owner = output // vocab
    flat.index_add_(0, output, -(freq[owner] * counts + pres[owner]))
    logits.index_copy_(0, index, sub)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, device=like.device, dtype=like.dtype).unsqueeze(1)


def _bias(logits: torch.Tensor, rows: Rows) -> None:
    _put(logits, [(i, token, bias) for i, p, _ in rows for token, bias in p.logit_bias], True)


def _bans(logits: torch.Tensor, rows: Rows) -> None:
    ban = float("-inf")
    _put(logits, [(i, token, ban) for i, p, history in rows for token in rule_bans(p, history)])


def _put(logits: torch.Tensor, cells: list[tuple[int, int, float]], add: bool = False) -> None:
    """Writes (or, with ``add``, adds) each ``(row, token, value)`` of ``cells`` into ``logits``."""
    if not cells:
        return
    rows, tokens, values = zip(*cells, strict=True)
    device = logits.device
    at = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
    logits.index_put_(at, torch.tensor(values, device=device, dtype=logits.dtype), accumulate=add)


def _allow(logits: torch.Tensor, rows: Rows) -> None:
    if not rows:
        return
    device = logits.device
    keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=device)
    for k, (_, p, _) in enumerate(rows):
        keep[k, torch.tensor(p.allowed_token_ids or (), dtype=torch.long, device=device)] = True
    index = torch.tensor([i for i, _, _ in rows], device=device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~keep, float("-inf")))
