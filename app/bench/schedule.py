"""A batch schedule's ideal: how many decode steps a list of output lengths needs on ``slots``
slots, with no overhead and one token per occupied slot per step.

Continuous batching refills a slot at the next step boundary (list scheduling in arrival
order); static batching admits the next ``slots`` requests only into an empty batch, so each
batch lasts as long as its longest request. Their step ratio is the most continuous batching
can gain over static batching on that workload (the limit Anyscale's benchmark measures
against); ideal tokens/s is ``sum(lengths) / (steps * step_seconds)``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def continuous_steps(lengths: Sequence[int], slots: int) -> int:
    """Steps to decode ``lengths`` in order with every freed slot refilled at once."""
    free_at = [0] * slots
    end = 0
    for length in lengths:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + length)
        end = max(end, start + length)
    return end


def static_steps(lengths: Sequence[int], slots: int) -> int:
    """Steps to decode ``lengths`` in batches of ``slots``, each as long as its longest."""
    return sum(max(lengths[i : i + slots]) for i in range(0, len(lengths), slots))
