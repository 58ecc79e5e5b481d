"""The seed's stateless mock model."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from app.models.mock_language import MockLanguage
from app.models.mock_sampling import sample_rows
from app.models.protocol import SampledRow, StepResult


class MockBase:
    """What both mocks share: the language that picks tokens. Their calls take microseconds and
    never wait (``blocking = False``: the engine runs them on the event loop); the GPU-like step
    time is the engine's step clock, not the model's."""

    blocking = False

    def __init__(self, language: MockLanguage | None = None, *, seed: int = 0) -> None:
        self.language = language or MockLanguage(seed=seed)

    @property
    def stop_token(self) -> int:
        return self.language.stop_token


class MockModel(MockBase):
    """``next_tokens(batch)`` with the seed's contract: each entry is a full prefix, one next
    token comes back per entry. Deterministic for a given ``language`` (see ``MockLanguage``);
    it keeps no state between calls. ``next_tokens_for`` honours the rows' sampling as
    ``app.models.mock_sampling`` describes."""

    returns_int_tokens = True  # the language picks ints (``returns_int_tokens``)

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        next_token = self.language.next_token
        return [next_token(prefix) for prefix in batch]

    def next_tokens_for(self, rows: Seq[SampledRow]) -> StepResult:
        return sample_rows(self.language.next_token, rows, self.language.vocab_size)
