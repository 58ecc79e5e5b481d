"""Back-to-back steps are paced from the previous deadline: the engine's own work between
steps is taken out of b0 (a GPU server's measured b0 contains its CPU work), never added."""

from __future__ import annotations

import asyncio

import pytest

from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.step_clock import StepClock, StepCosts, StepTimeModel, StepWork
from app.engine.types import Sequence
from app.models.mock import MockModel

CLOCK = StepClock(StepCosts(step_ms=5.0, prefill_token_ms=0.01, decode_token_ms=0.1))


def test_after_idle_a_step_lasts_its_duration_from_its_start() -> None:
    assert CLOCK.paced_deadline(10.0, StepWork.counts(100, 4), None) == pytest.approx(10.0 + 0.0064)


def test_overhead_under_b0_is_absorbed_so_steps_come_every_duration() -> None:
    previous = 10.0
    # the engine took 3 ms after the previous deadline to plan this step: still 5.4 ms apart
    assert CLOCK.paced_deadline(previous + 0.003, StepWork.counts(0, 4), previous) == pytest.approx(
        10.0054
    )


def test_overhead_over_b0_is_only_absorbed_up_to_b0() -> None:
    previous = 10.0
    # 8 ms of overhead: b0 (5 ms) of it is absorbed, the rest delays the step
    deadline = CLOCK.paced_deadline(previous + 0.008, StepWork.counts(0, 4), previous)
    assert deadline == pytest.approx(10.008 - 0.005 + 0.0054)
    assert deadline >= previous + 0.008 + 0.0004 - 1e-9  # never before start + b1*p + b2*d


class RecordingClock(StepClock):
    """Records the ``previous`` deadline the engine passes for each step."""

    def __init__(self, costs: StepTimeModel) -> None:
        super().__init__(costs)
        self.previous: list[float | None] = []

    def paced_deadline(self, started_at: float, work: StepWork, previous: float | None) -> float:
        self.previous.append(previous)
        return super().paced_deadline(started_at, work, previous)


async def test_the_engine_paces_back_to_back_steps_and_restarts_after_idle() -> None:
    engine = Engine(MockModel(), EngineConfig(num_slots=2, step_costs=StepCosts(step_ms=1.0)))
    clock = engine.clock = RecordingClock(engine.config.step_costs)
    await engine.start()
    try:
        for run in range(2):
            stream = engine.submit(Sequence(f"r{run}", [72, 105], 3, frozenset()))
            tokens, _, _ = await stream.collect()
            assert len(tokens) == 3
            await engine.wait_idle()
    finally:
        await engine.stop()
    # each request: a first step after idle (no previous), then two paced steps
    first, second = clock.previous[:3], clock.previous[3:]
    assert first[0] is None and second[0] is None
    assert all(p is not None for p in first[1:] + second[1:])


async def test_an_admission_delay_holds_a_request_before_the_queue() -> None:
    config = EngineConfig(num_slots=2, step_costs=StepCosts(step_ms=20.0), admission_delay=0.05)
    engine = Engine(MockModel(), config)
    await engine.start()
    try:
        seq = Sequence("r0", [72, 105], 2, frozenset())
        tokens, _, _ = await engine.submit(seq).collect()
    finally:
        await engine.stop()
    assert len(tokens) == 2
    assert seq.times.first_token is not None
    assert seq.times.first_token - seq.times.arrival >= 0.05 + 0.02 - 1e-3  # delay, then a step


async def test_late_admission_joins_one_step_after_the_next() -> None:
    """A request arriving while steps run is scheduled one step later than the next one: its
    first token comes two whole steps after the step it arrived in ends."""
    config = EngineConfig(num_slots=2, step_costs=StepCosts(step_ms=20.0), late_admission=True)
    engine = Engine(MockModel(), config)
    await engine.start()
    try:
        long = engine.submit(Sequence("long", [72, 105], 30, frozenset()))
        await asyncio.sleep(0.1)  # a schedule: let the long request decode a few steps
        seq = Sequence("late", [72, 105], 2, frozenset())
        tokens, _, _ = await engine.submit(seq).collect()
        await long.collect()
    finally:
        await engine.stop()
    assert len(tokens) == 2 and seq.times.first_token is not None
    assert seq.times.first_token - seq.times.arrival >= 2 * 0.02 - 1e-3
