"""``HFModel``: a real checkpoint behind the engine's ``CachedModel`` protocol.

Each ``step`` runs ONE forward pass over all of the step's tokens (one per decoding slot, then
every prefill chunk's tokens), each at its own position in its own slot's cache, and samples one
token per decode slot and per chunk that completes a prefill.
"""

from __future__ import annotations

import torch

from app.models.hf.attention import StepLayout
from app.models.hf.kv_cache import KVCache
from app.models.hf.llama import LlamaForward
from app.models.hf.sampling import Sampler
from app.models.protocol import PrefillChunk, SamplingParams, StepBatch


class SlotStateError(RuntimeError):
    """The engine broke the cache contract: a chunk does not start where its slot's cache ends,
    or a slot would outgrow its context."""


class HFModel:
    """A cached model over a preallocated KV cache (see ``KVCache``). ``blocking`` is True: the
    engine runs ``step`` and ``release`` in its worker thread."""

    blocking = True

    def __init__(self, forward: LlamaForward, sampler: Sampler) -> None:
        self._forward = forward
        self._sampler = sampler
        self.cache: KVCache = forward.cache
        self.device = forward.weights.embed.device

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    @property
    def max_model_len(self) -> int:
        """Positions per slot: the longest prompt + output one request can have."""
        return self.cache.context

    @property
    def kv_capacity_tokens(self) -> int:
        return self.cache.capacity_tokens

    def release(self, slot: int) -> None:
        self.cache.lengths[slot] = 0

    def step(self, batch: StepBatch) -> list[int]:
        if not batch.decode_slots and not batch.prefills:
            return []
        logits, params, positions = self._run(batch)
        with torch.inference_mode():
            logits = self._before_sampling(logits, params, positions)
            return self._sampler.sample(logits, params, positions)

    def _before_sampling(
        self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
    ) -> torch.Tensor:
        """THE place where the stages between the forward and the draw run, in this order,
        each over the float32 logits (rows, vocab) of the step's output rows and skipped
        entirely when no row needs it: 1. logits processors (penalties, logit_bias, min_tokens,
        bad_words, allowed_token_ids), 2. grammar token masks, 3. logprobs capture. Returns the
        logits the ``Sampler`` draws from (none of these stages exists yet: unchanged)."""
        del params, positions
        return logits

    def step_logits(self, batch: StepBatch) -> torch.Tensor:
        """Runs ``batch`` exactly as ``step`` does (the cache advances) but returns the float32
        logits of its output rows instead of sampling (for tests and benchmarks)."""
        return self._run(batch)[0]

    def _run(self, batch: StepBatch) -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
        """One forward pass; returns the output rows' logits, sampling parameters and the
        positions the sampled tokens will take."""
        lengths = self.cache.lengths
        decode_slots = list(batch.decode_slots)
        decode_positions = [lengths[slot] for slot in decode_slots]
        for chunk in batch.prefills:
            self._check_chunk(chunk)
        for slot, position in zip(decode_slots, decode_positions, strict=True):
            self._check_room(slot, position + 1)
        layout = StepLayout.build(
            decode_slots,
            decode_positions,
            [(c.slot, c.start, len(c.token_ids)) for c in batch.prefills],
            self.device,
        )
        tokens = list(batch.decode_tokens)
        rows = list(range(len(tokens)))
        params: list[SamplingParams] = list(batch.decode_sampling)
        positions = [p + 1 for p in decode_positions]
        for chunk in batch.prefills:
            tokens.extend(chunk.token_ids)
            if chunk.sample:
                rows.append(len(tokens) - 1)
                params.append(chunk.sampling)
                positions.append(chunk.start + len(chunk.token_ids))
        with torch.inference_mode():
            logits = self._forward(
                torch.tensor(tokens, device=self.device),
                layout,
                torch.tensor(rows, device=self.device, dtype=torch.long),
            )
        for slot in decode_slots:
            lengths[slot] += 1
        for chunk in batch.prefills:
            lengths[chunk.slot] = chunk.start + len(chunk.token_ids)
        return logits, params, positions

    def _check_chunk(self, chunk: PrefillChunk) -> None:
        cached = self.cache.lengths[chunk.slot]
        if chunk.start != cached:
            raise SlotStateError(
                f"slot {chunk.slot}: chunk of {chunk.request_id!r} starts at {chunk.start} but "
                f"the slot caches {cached} positions"
            )
        if not chunk.token_ids:
            raise SlotStateError(f"slot {chunk.slot}: empty prefill chunk")
        self._check_room(chunk.slot, chunk.start + len(chunk.token_ids))

    def _check_room(self, slot: int, length: int) -> None:
        if length > self.cache.context:
            raise SlotStateError(
                f"slot {slot}: {length} positions exceed the context of {self.cache.context}"
            )
