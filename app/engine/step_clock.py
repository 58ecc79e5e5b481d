"""The engine's step clock: how long a step takes on the hardware being imitated.

A step that feeds ``p`` prefill tokens and ``d`` decode tokens lasts ``b0 + b1 * p + b2 * d``
milliseconds (the linear fit GPU simulators such as BLIS use), optionally with Gaussian jitter.
The engine sleeps on the event loop until ``step start + duration`` once the model call has
returned, so a mock step of latency L takes L in all, not L plus the engine's own bookkeeping,
and nothing sleeps in a worker thread. A real model leaves the clock at zero: its own compute
time is the step time.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

JITTER_CAP = 0.3  # a jittered step stays within +-30% of its mean, like llm-d-inference-sim
TIMER_SLACK = 0.001  # seconds: the event loop's timers wake up to 1 ms late (epoll's ms ticks)


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Milliseconds: ``step_ms`` per step (b0), ``prefill_token_ms`` per prefill token (b1),
    ``decode_token_ms`` per decode token (b2). All zero (the default): no simulated time."""

    step_ms: float = 0.0
    prefill_token_ms: float = 0.0
    decode_token_ms: float = 0.0
    jitter: float = 0.0  # standard deviation as a fraction of the mean
    lora_load_ms: float = 0.0  # per LoRA adapter a step loads into the batch

    @property
    def enabled(self) -> bool:
        return bool(
            self.step_ms or self.prefill_token_ms or self.decode_token_ms or self.lora_load_ms
        )

    def mean_seconds(self, prefill_tokens: int, decode_tokens: int, lora_loads: int = 0) -> float:
        ms = self.step_ms + self.prefill_token_ms * prefill_tokens + self.lora_load_ms * lora_loads
        return (ms + self.decode_token_ms * decode_tokens) / 1000.0


class StepClock:
    """Gives each step its deadline. Seeded, so a jittered run is reproducible."""

    def __init__(self, costs: StepCosts, seed: int = 0) -> None:
        self.costs = costs
        self._rng = random.Random(seed)

    @property
    def enabled(self) -> bool:
        return self.costs.enabled

    def duration(self, prefill_tokens: int, decode_tokens: int, lora_loads: int = 0) -> float:
        """Seconds the step lasts (jittered within +-``JITTER_CAP`` of its mean)."""
        mean = self.costs.mean_seconds(prefill_tokens, decode_tokens, lora_loads)
        jitter = min(self.costs.jitter, JITTER_CAP)
        if jitter and mean:
            mean *= 1.0 + max(-JITTER_CAP, min(JITTER_CAP, self._rng.gauss(0.0, jitter)))
        return mean

    def deadline(self, started_at: float, prefill_tokens: int, decode_tokens: int) -> float:
        return started_at + self.duration(prefill_tokens, decode_tokens)

    def paced_deadline(
        self,
        started_at: float,
        prefill_tokens: int,
        decode_tokens: int,
        previous: float | None,
        lora_loads: int = 0,
    ) -> float:
        """The deadline of a step planned at ``started_at`` right after a step that ended at
        ``previous`` (None: the engine was idle in between). A GPU server's CPU work between
        steps (applying tokens, streaming, scheduling) is part of its measured b0, so the
        engine's own is taken out of b0 rather than added to it: the step counts from the
        previous deadline, or from ``started_at - b0`` if the engine took longer than b0.
        Back-to-back steps thus come every ``b0 + b1 * p + b2 * d`` while the engine's work
        between them stays under b0, and no step ends before ``started_at + b1 * p + b2 * d``."""
        start = started_at
        if previous is not None:
            start = max(previous, started_at - self.costs.step_ms / 1000.0)
        return start + self.duration(prefill_tokens, decode_tokens, lora_loads)


NO_STEP_TIME = StepCosts()


async def sleep_until(deadline: float, clock: Callable[[], float] = time.monotonic) -> None:
    """Sleep on the event loop until ``clock() >= deadline``, to within tens of microseconds.

    asyncio's timers round a wait up to the next millisecond (epoll counts milliseconds), which
    would add half a millisecond to every step on average: 10% of a 5 ms step. So it sleeps
    until just before the deadline and yields to other tasks for the rest, which keeps streams,
    submits and aborts running meanwhile. It yields at least once, also when the deadline has
    passed (a step that overran it): the event loop serves its other tasks and connections
    between any two steps.
    """
    remaining = deadline - clock()
    if remaining > TIMER_SLACK:
        await asyncio.sleep(remaining - TIMER_SLACK)
    else:
        await asyncio.sleep(0)
    while clock() < deadline:  # noqa: ASYNC110 (a deadline, not an event, ends this wait)
        await asyncio.sleep(0)
