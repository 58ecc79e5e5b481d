"""Simulated step latency for the mock models: ``base + per_seq * batch + per_prefill_token *
new_prompt_tokens`` milliseconds, with optional Gaussian jitter.

The latency is measured from the start of the engine's step (``STEP_STARTED``, set by the model
runner from the step plan), so a step of latency L takes L in all, not L plus the engine's own
bookkeeping time.
"""

from __future__ import annotations

import random
import time
from contextvars import ContextVar
from dataclasses import dataclass

STEP_STARTED: ContextVar[float | None] = ContextVar("STEP_STARTED", default=None)
"""``time.monotonic()`` at the start of the current engine step, if an engine is stepping."""

JITTER_CAP = 0.3  # a jittered step stays within +-30% of its mean, like llm-d-inference-sim


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """Milliseconds per step. All zero (the default) means no simulated latency."""

    base_ms: float = 0.0
    per_seq_ms: float = 0.0
    per_prefill_token_ms: float = 0.0
    jitter: float = 0.0  # standard deviation as a fraction of the mean

    @property
    def enabled(self) -> bool:
        return bool(self.base_ms or self.per_seq_ms or self.per_prefill_token_ms)

    def seconds(self, batch_size: int, prefill_tokens: int, rng: random.Random) -> float:
        mean = self.base_ms + self.per_seq_ms * batch_size
        mean += self.per_prefill_token_ms * prefill_tokens
        if self.jitter:
            spread = min(self.jitter, JITTER_CAP)
            mean *= 1.0 + max(-JITTER_CAP, min(JITTER_CAP, rng.gauss(0.0, spread)))
        return mean / 1000.0


class StepTimer:
    """Sleeps a model call until its simulated step latency has passed since the step began."""

    def __init__(self, profile: LatencyProfile, seed: int = 0) -> None:
        self.profile = profile
        self._rng = random.Random(seed)

    def wait(self, batch_size: int, prefill_tokens: int) -> None:
        if not self.profile.enabled:
            return
        started = STEP_STARTED.get()
        if started is None:
            started = time.monotonic()
        deadline = started + self.profile.seconds(batch_size, prefill_tokens, self._rng)
        remaining = deadline - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
