"""A mock with a real per-slot key/value cache: the seed's first follow-up, made testable."""

from __future__ import annotations

from app.models.latency import LatencyProfile
from app.models.mock import MockBase
from app.models.mock_language import MockLanguage


class SlotReuseError(RuntimeError):
    """A slot was assigned, or decoded, against the cache contract."""


class CachedMockModel(MockBase):
    """Implements ``CachedModel``. Each slot's cache is the token list the model has seen for the
    request in it; ``decode`` appends the previous step's token and predicts from the cache, so
    its outputs equal ``MockModel``'s for the same prefix. Assigning a slot whose cache was not
    released, or decoding an unassigned slot, raises ``SlotReuseError``.
    """

    def __init__(
        self,
        num_slots: int,
        language: MockLanguage | None = None,
        latency: LatencyProfile | None = None,
        *,
        seed: int = 0,
    ) -> None:
        super().__init__(language, latency, seed=seed)
        self._cache: list[list[int] | None] = [None] * num_slots
        self._pending_prefill = 0

    def cache_usage(self) -> float:
        """Fraction of slots whose cache is in use."""
        return sum(c is not None for c in self._cache) / len(self._cache)

    def assign(self, slot: int, prompt: list[int]) -> None:
        if self._cache[slot] is not None:
            raise SlotReuseError(f"slot {slot} assigned while its cache still holds a request")
        self._cache[slot] = list(prompt)
        self._pending_prefill += len(prompt)

    def release(self, slot: int) -> None:
        if self._cache[slot] is None:
            raise SlotReuseError(f"slot {slot} released twice")
        self._cache[slot] = None

    def decode(self, slots: list[int], last_tokens: list[int | None]) -> list[int]:
        prefill, self._pending_prefill = self._pending_prefill, 0
        self._timer.wait(len(slots), prefill)
        out: list[int] = []
        for slot, token in zip(slots, last_tokens, strict=True):
            cache = self._cache[slot]
            if cache is None:
                raise SlotReuseError(f"slot {slot} decoded without an assigned request")
            if token is not None:
                cache.append(token)
            out.append(self.language.next_token(cache))
        return out
