"""Back-to-back steps are paced from the previous deadline: the engine's own work between
steps is taken out of b0 (a GPU server's measured b0 contains its CPU work), never added."""

from __future__ import annotations

import pytest

from app.engine.step_clock import StepClock, StepCosts

CLOCK = StepClock(StepCosts(step_ms=5.0, prefill_token_ms=0.01, decode_token_ms=0.1))


def test_after_idle_a_step_lasts_its_duration_from_its_start() -> None:
    assert CLOCK.paced_deadline(10.0, 100, 4, None) == pytest.approx(10.0 + 0.0064)


def test_overhead_under_b0_is_absorbed_so_steps_come_every_duration() -> None:
    previous = 10.0
    # the engine took 3 ms after the previous deadline to plan this step: still 5.4 ms apart
    assert CLOCK.paced_deadline(previous + 0.003, 0, 4, previous) == pytest.approx(10.0054)


def test_overhead_over_b0_is_only_absorbed_up_to_b0() -> None:
    previous = 10.0
    # 8 ms of overhead: b0 (5 ms) of it is absorbed, the rest delays the step
    deadline = CLOCK.paced_deadline(previous + 0.008, 0, 4, previous)
    assert deadline == pytest.approx(10.008 - 0.005 + 0.0054)
    assert deadline >= previous + 0.008 + 0.0004 - 1e-9  # never before start + b1*p + b2*d
