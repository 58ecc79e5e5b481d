"""Log probabilities for the real model: the log-softmax of a row's logits after the logits
processors (penalties, biases, bans) and before temperature, top-k, top-p and min-p (between
vLLM's ``raw_logprobs``, its default, and its ``processed_logprobs``: a banned token shows -inf).
Prompt tokens' log probabilities come from the raw logits (no processor applies to a prompt),
as lm-evaluation-harness expects of a loglikelihood."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.models.protocol import Logprobs


def entries(logits: torch.Tensor, targets: Sequence[int], tops: Sequence[int]) -> list[Logprobs]:
    """For each row of ``logits`` (rows, vocab): ``targets[i]``'s log-probability and the
    ``tops[i]`` most likely tokens. One log-softmax and one top-k for all rows."""
    if not targets:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(targets), device=logits.device).unsqueeze(1)
    gathered = logprobs.gather(1, index)
    chosen = gathered.squeeze(1).tolist()
    ranks = ((logprobs > gathered).sum(dim=1) + 1).tolist()  # 1 + the tokens more likely
    k = max(tops)
    top_values: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out: list[Logprobs] = []
    for i, (token, value) in enumerate(zip(targets, chosen, strict=True)):
        k = tops[i]
        top = tuple(zip(top_ids[i][:k], top_values[i][:k], strict=True))
        out.append(Logprobs(token, value, top, int(ranks[i])))
    return out
