"""The seed's stateless mock model, with simulated step latency."""

from __future__ import annotations

from app.models.latency import LatencyProfile, StepTimer
from app.models.mock_language import MockLanguage


class MockBase:
    """What both mocks share: the language that picks tokens and the simulated step latency."""

    def __init__(
        self, language: MockLanguage | None, latency: LatencyProfile | None, *, seed: int
    ) -> None:
        self.language = language or MockLanguage(seed=seed)
        self.latency = latency or LatencyProfile()
        self._timer = StepTimer(self.latency, seed=self.language.seed)

    @property
    def blocking(self) -> bool:
        """Only a simulated step latency (a sleep) blocks; otherwise a call takes microseconds."""
        return self.latency.enabled

    @property
    def stop_token(self) -> int:
        return self.language.stop_token


class MockModel(MockBase):
    """``next_tokens(batch)`` with the seed's contract: each entry is a full prefix, one next
    token comes back per entry. Deterministic for a given ``language`` (see ``MockLanguage``).

    The only state it keeps is for latency accounting: the sequences of the previous call, so a
    sequence it has not seen before counts as a prefill of its whole length. Outputs never
    depend on it.
    """

    def __init__(
        self,
        language: MockLanguage | None = None,
        latency: LatencyProfile | None = None,
        *,
        seed: int = 0,
    ) -> None:
        super().__init__(language, latency, seed=seed)
        self._previous: dict[int, list[int]] = {}

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        if self.latency.enabled:
            self._timer.wait(len(batch), self._prefill_tokens(batch))
        next_token = self.language.next_token
        return [next_token(prefix) for prefix in batch]

    def _prefill_tokens(self, batch: list[list[int]]) -> int:
        """Tokens of the sequences absent from the previous call (holding that call's lists keeps
        their ids from being reused)."""
        current = {id(prefix): prefix for prefix in batch}
        new = sum(len(prefix) for key, prefix in current.items() if key not in self._previous)
        self._previous = current
        return new
