"""The engine's step clock: how long a step takes on the hardware being imitated.

The engine knows nothing of GPUs. Each step it hands the clock a ``StepWork`` (what the batch
does: each prefill chunk's length and context start, each decoding request's context length,
the LoRA adapters it loads) and a ``StepTimeModel`` turns that into seconds. Two models exist:
``StepCosts`` here (``b0 + b1 * prefill tokens + b2 * decode tokens`` milliseconds, the linear
fit GPU simulators such as BLIS use) and the roofline model of ``app.step_time`` (a model's
config.json on a GPU's datasheet). ``StepClock`` adds optional Gaussian jitter and paces steps.

The engine sleeps on the event loop until ``step start + duration`` once the model call has
returned, so a mock step of latency L takes L in all, not L plus the engine's own bookkeeping,
and nothing sleeps in a worker thread. A real model leaves the clock at zero: its own compute
time is the step time. ``app.simulate`` runs the same clock on a virtual clock.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from app.engine.step import SchedulerOutput

JITTER_CAP = 0.3  # a jittered step stays within +-30% of its mean, like llm-d-inference-sim
TIMER_SLACK = 0.001  # seconds: the event loop's timers wake up to 1 ms late (epoll's ms ticks)


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step's batch does, as a step-time model sees it.

    ``prefill_lengths[i]`` tokens of a prompt are fed at positions starting at
    ``prefill_starts[i]`` (the context already cached for that request: a prefix-cache hit or
    an earlier chunk); ``decode_contexts[j]`` is the context length (prompt + generated tokens)
    of the j-th decoding request, which reads all of it and adds one token; ``sampled`` counts
    the tokens the step samples (decodes plus prefill chunks that complete a prompt);
    ``lora_loads`` the LoRA adapters loaded into the batch in this step.
    """

    prefill_lengths: tuple[int, ...] = ()
    prefill_starts: tuple[int, ...] = ()
    decode_contexts: tuple[int, ...] = ()
    sampled: int = 0
    lora_loads: int = 0
    num_prefill_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_prefill_tokens", sum(self.prefill_lengths))

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_contexts)

    @property
    def num_requests(self) -> int:
        return len(self.prefill_lengths) + len(self.decode_contexts)

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepWork:
        """The work of one scheduled step."""
        chunks = out.prefills
        return cls(
            tuple(len(chunk.token_ids) for chunk in chunks),
            tuple(chunk.start for chunk in chunks),
            tuple(len(seq.tokens) for seq in out.decode_seqs),
            len(out.decode_seqs) + sum(1 for chunk in chunks if chunk.sample),
            out.lora_loads,
        )

    @classmethod
    def counts(cls, prefill_tokens: int, decode_tokens: int, lora_loads: int = 0) -> StepWork:
        """A step of one prefill chunk of ``prefill_tokens`` from an empty cache and
        ``decode_tokens`` decodes of one-token contexts (for models that only count tokens)."""
        prefill = (prefill_tokens,) if prefill_tokens else ()
        return cls(prefill, (0,) * len(prefill), (1,) * decode_tokens, decode_tokens, lora_loads)


class StepTimeModel(Protocol):
    """Turns a step's work into seconds of the imitated hardware."""

    @property
    def enabled(self) -> bool:
        """False: steps take no simulated time at all."""
        ...

    @property
    def host_seconds(self) -> float:
        """The part of every step that is the server's CPU work between GPU steps: the engine's
        own work between steps hides in it when steps are paced (see ``paced_deadline``)."""
        ...

    def seconds(self, work: StepWork) -> float:
        """The mean duration of a step doing ``work``."""
        ...


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Milliseconds: ``step_ms`` per step (b0), ``prefill_token_ms`` per prefill token (b1),
    ``decode_token_ms`` per decode token (b2). All zero (the default): no simulated time."""

    step_ms: float = 0.0
    prefill_token_ms: float = 0.0
    decode_token_ms: float = 0.0
    lora_load_ms: float = 0.0  # per LoRA adapter a step loads into the batch

    @property
    def enabled(self) -> bool:
        return bool(
            self.step_ms or self.prefill_token_ms or self.decode_token_ms or self.lora_load_ms
        )

    @property
    def host_seconds(self) -> float:
        return self.step_ms / 1000.0

    def mean_seconds(self, prefill_tokens: int, decode_tokens: int, lora_loads: int = 0) -> float:
        ms = self.step_ms + self.prefill_token_ms * prefill_tokens + self.lora_load_ms * lora_loads
        return (ms + self.decode_token_ms * decode_tokens) / 1000.0

    def seconds(self, work: StepWork) -> float:
        return self.mean_seconds(work.num_prefill_tokens, work.num_decode_tokens, work.lora_loads)


class StepClock:
    """Gives each step its deadline: the model's mean, with Gaussian ``jitter`` (standard
    deviation as a fraction of the mean, capped at ``JITTER_CAP``). Seeded, so a jittered run
    is reproducible."""

    def __init__(self, model: StepTimeModel, seed: int = 0, jitter: float = 0.0) -> None:
        self.model = model
        self.jitter = min(jitter, JITTER_CAP)
        self._rng = random.Random(seed)

    @property
    def enabled(self) -> bool:
        return self.model.enabled

    def duration(self, work: StepWork) -> float:
        """Seconds the step lasts (jittered within +-``JITTER_CAP`` of its mean)."""
        mean = self.model.seconds(work)
        if self.jitter and mean:
            mean *= 1.0 + max(-JITTER_CAP, min(JITTER_CAP, self._rng.gauss(0.0, self.jitter)))
        return mean

    def deadline(self, started_at: float, work: StepWork) -> float:
        return started_at + self.duration(work)

    def paced_deadline(self, started_at: float, work: StepWork, previous: float | None) -> float:
        """The deadline of a step planned at ``started_at`` right after a step that ended at
        ``previous`` (None: the engine was idle in between). A GPU server's CPU work between
        steps (applying tokens, streaming, scheduling) is part of its measured step time
        (``host_seconds``: b0 for the linear model), so the engine's own is taken out of it
        rather than added to it: the step counts from the previous deadline, or from
        ``started_at - host_seconds`` if the engine took longer than that. Back-to-back steps
        thus come every ``duration`` while the engine's work between them stays under
        ``host_seconds``, and no step ends before ``started_at + duration - host_seconds``."""
        start = started_at
        if previous is not None:
            start = max(previous, started_at - self.model.host_seconds)
        return start + self.duration(work)


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
