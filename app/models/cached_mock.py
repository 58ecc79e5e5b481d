"""A mock with a real per-slot key/value cache: the seed's first follow-up, made testable."""

from __future__ import annotations

from app.models.mock import MockBase
from app.models.mock_language import MockLanguage
from app.models.mock_sampling import pick, prompt_logprobs
from app.models.protocol import (
    Logprobs,
    PrefillChunk,
    StepBatch,
    StepResult,
)


class SlotReuseError(RuntimeError):
    """A slot was used against the cache contract (see ``CachedModel``)."""


class CachedMockModel(MockBase):
    """Implements ``CachedModel``. Each slot's cache is the list of tokens the model has
    processed for the request in it; a step appends what it is fed and predicts from the cache,
    so its outputs equal ``MockModel``'s for the same prefix. It checks the contract: a chunk
    with ``start == 0`` must find the slot's cache empty (released), any other entry must find
    exactly ``start`` (or, for a decode, some) tokens there; otherwise ``SlotReuseError``.
    Releasing is idempotent.
    A chunk with a cached ``prefix`` must find the slot released too: the prefix is copied into
    it (the mock's cache is its tokens), so its outputs are those of a full prefill.
    """

    returns_int_tokens = True  # the language picks ints (``returns_int_tokens``)

    supports_prefix_caching = True
    copies_slots = True  # a fork's prefix is copied as its tokens (checked against the source)

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
        """Idempotent, as the protocol asks: a slot whose first chunk failed holds nothing."""
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
            cache = self._prefill(chunk)
            if chunk.sample:
                out.append(next_token(cache))
        return out

    def _check_fork(self, chunk: PrefillChunk) -> None:
        """A fork's source slot must hold its ``prefix`` as the step starts (the contract a
        real model relies on to copy the key/values)."""
        source = chunk.prefix_slot
        if source is None:
            return
        held = self._cache[source]
        if held is None or held[: chunk.start] != list(chunk.prefix):
            raise SlotReuseError(
                f"slot {chunk.slot}: fork of {chunk.request_id!r} from slot {source}, which "
                f"does not hold its {chunk.start}-token prefix"
            )

    def _prefill(self, chunk: PrefillChunk) -> list[int]:
        """Feed ``chunk`` to its slot's cache (checked: see the class); returns the cache."""
        self._check_fork(chunk)
        slot, start, prefix = chunk.slot, chunk.start, chunk.prefix
        cache = self._cache[slot]
        if start == len(prefix):  # a fresh slot (with a cached prefix when start > 0)
            if cache is not None:
                raise SlotReuseError(f"slot {slot} got a fresh prefill while its cache is in use")
            cache = self._cache[slot] = list(prefix)
        elif cache is None or len(cache) != start:
            held = 0 if cache is None else len(cache)
            raise SlotReuseError(f"slot {slot}: chunk starts at {start}, cache holds {held}")
        cache.extend(chunk.token_ids)
        return cache

    def step_sampled(self, batch: StepBatch) -> StepResult:
        """``step`` for a batch where some row's sampling is not plain: each token is chosen
        and reported as ``app.models.mock_sampling`` describes."""
        next_token, vocab = self.language.next_token, self.language.vocab_size
        picked: list[tuple[int, Logprobs | None]] = []
        prompts: dict[str, tuple[int, list[Logprobs]]] = {}
        rows = zip(batch.decode_slots, batch.decode_tokens, batch.decode_sampling, strict=True)
        for i, (slot, token, params) in enumerate(rows):
            cache = self._cache[slot]
            if not cache:
                raise SlotReuseError(f"slot {slot} decoded without a prefilled request")
            cache.append(token)
            history = batch.decode_histories[i] if batch.decode_histories else None
            picked.append(pick(next_token(cache), params, history, vocab))
        for chunk in batch.prefills:
            cache = self._prefill(chunk)
            self._prompt_logprobs(chunk, prompts)
            if chunk.sample:
                picked.append(pick(next_token(cache), chunk.sampling, chunk.history, vocab))
        return StepResult([t for t, _ in picked], [entry for _, entry in picked], prompts)

    def _prompt_logprobs(
        self, chunk: PrefillChunk, out: dict[str, tuple[int, list[Logprobs]]]
    ) -> None:
        count, first, history = chunk.prompt_logprob_count, chunk.start + 1, chunk.history
        if count and history is not None:
            language, top = self.language, chunk.sampling.prompt_logprobs or 0
            entries = prompt_logprobs(
                language.next_token, history.tokens, first, first + count, top, language.vocab_size
            )
            out[chunk.request_id] = (first, entries)
