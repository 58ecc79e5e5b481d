"""Regression tests, each named after the bug it pins."""

from __future__ import annotations

from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.types import FinishReason, Sequence
from app.models.cached_mock import CachedMockModel


def _seq(request_id: str, max_tokens: int) -> Sequence:
    return Sequence(request_id, [72, 105], max_tokens, frozenset())


async def test_slot_release_is_not_lost_when_the_batch_empties_after_an_abort() -> None:
    """Found by schemathesis: aborting the only running request left a plan with no batch; its
    released slot was dropped with it, so the cached model was never told to reset the slot and
    the next request assigned to it failed with SlotReuseError."""
    engine = Engine(CachedMockModel(1), EngineConfig(num_slots=1))
    await engine.start()
    try:
        first = engine.submit(_seq("a", 10_000))
        await anext(first)
        engine.abort("a")
        assert (await first.collect())[1] is FinishReason.ABORT
        await engine.wait_idle()
        tokens, reason, error = await engine.submit(_seq("b", 5)).collect()
        assert error is None and reason is FinishReason.LENGTH and len(tokens) == 5
    finally:
        await engine.stop()
