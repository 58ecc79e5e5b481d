"""A mock with a real per-slot key/value cache: the seed's first follow-up, made testable."""

from __future__ import annotations

from app.models.mock import MockBase
from app.models.mock_language import MockLanguage
from app.models.protocol import StepBatch


class SlotReuseError(RuntimeError):
    """A slot was used against the cache contract (see ``CachedModel``)."""


class CachedMockModel(MockBase):
    """Implements ``CachedModel``. Each slot's cache is the list of tokens the model has
    processed for the request in it; a step appends what it is fed and predicts from the cache,
    so its outputs equal ``MockModel``'s for the same prefix. It checks the contract: a chunk
    with ``start == 0`` must find the slot's cache empty (released), any other entry must find
    exactly ``start`` (or, for a decode, some) tokens there; otherwise ``SlotReuseError``.
    """

    def __init__(
        self, num_slots: int, language: MockLanguage | None = None, *, seed: int = 0
    ) -> None:
        super().__init__(language, seed=seed)
        self._cache: list[list[int] | None] = [None] * num_slots

    def cached_tokens(self, slot: int) -> int:
        """Tokens held in ``slot``'s cache (0 when released)."""
        return len(self._cache[slot] or ())

    def held_slots(self) -> list[int]:
        """The slots whose cache is in use (not released)."""
        return [slot for slot, cache in enumerate(self._cache) if cache is not None]

    def release(self, slot: int) -> None:
        if self._cache[slot] is None:
            raise SlotReuseError(f"slot {slot} released twice")
        self._cache[slot] = None

    def step(self, batch: StepBatch) -> list[int]:
        next_token, caches = self.language.next_token, self._cache
        out: list[int] = []
        for slot, token in zip(batch.decode_slots, batch.decode_tokens, strict=True):
            cache = caches[slot]
            if not cache:
                raise SlotReuseError(f"slot {slot} decoded without a prefilled request")
            cache.append(token)
            out.append(next_token(cache))
        for chunk in batch.prefills:
            cache = self._prefill(chunk.slot, chunk.token_ids, chunk.start)
            if chunk.sample:
                out.append(next_token(cache))
        return out

    def _prefill(self, slot: int, tokens: list[int], start: int) -> list[int]:
        cache = self._cache[slot]
        if start == 0:
            if cache is not None:
                raise SlotReuseError(f"slot {slot} got a fresh prefill while its cache is in use")
            cache = self._cache[slot] = []
        elif cache is None or len(cache) != start:
            held = 0 if cache is None else len(cache)
            raise SlotReuseError(f"slot {slot}: chunk starts at {start}, cache holds {held}")
        cache.extend(tokens)
        return cache
