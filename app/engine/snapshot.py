"""A read-only picture of the engine at one instant, for views (the dashboard, ``/slots``).

Built by ``EngineCore.snapshot`` on the engine's thread in O(slots + shown waiting requests);
it holds plain values only, so whoever reads it can never change the engine's state.
"""

from __future__ import annotations

from dataclasses import dataclass

WAITING_SHOWN = 64  # the waiting requests a snapshot names, in queue order (the rest are counted)


@dataclass(frozen=True, slots=True)
class SlotView:
    """The request in one slot: its id, whether it is still prefilling its prompt, tokens
    generated of ``max_tokens``, and how often it was preempted."""

    request_id: str
    prefilling: bool
    generated: int
    max_tokens: int
    preemptions: int


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """``slots[i]`` is slot i's request (None: free); ``waiting`` the first ``WAITING_SHOWN``
    queued request ids of ``num_waiting``; ``kv_usage`` the share of KV blocks in use."""

    slots: tuple[SlotView | None, ...]
    out_of_service: frozenset[int]
    waiting: tuple[str, ...]
    num_waiting: int
    kv_usage: float
