"""``HFModel``: a real checkpoint behind the engine's ``CachedModel`` protocol.

Each ``step`` runs ONE forward pass over all of the step's tokens (one per decoding slot, then
every prefill chunk's tokens), each at its own position in its own slot's cache, and samples one
token per decode slot and per chunk that completes a prefill.
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.models.hf import logits_processors, logprobs
from app.models.hf.attention import StepLayout
from app.models.hf.kv_cache import KVCache
from app.models.hf.llama import LlamaForward
from app.models.hf.sampling import Sampler
from app.models.hf.threads import StepThreads
from app.models.hf.token_mask import apply_token_masks
from app.models.protocol import (
    NO_TOKEN,
    Logprobs,
    PrefillChunk,
    SamplingParams,
    StepBatch,
    StepResult,
    TokenHistory,
)

PromptRows = list[tuple[PrefillChunk, int]]  # a chunk scored for prompt logprobs, its rows


class SlotStateError(RuntimeError):
    """The engine broke the cache contract: a chunk does not start where its slot's cache ends,
    or a slot would outgrow its context."""


class HFModel:
    """A cached model over a preallocated KV cache (see ``KVCache``). ``blocking`` is True: the
    engine runs ``step`` and ``release`` in its worker thread."""

    blocking = True
    applies_token_masks = True  # samples under StepBatch.token_masks (structured outputs)
    copies_slots = True  # starts a fork from another slot's cache (PrefillChunk.prefix_slot)
    returns_int_tokens = True  # its tokens come from ``Tensor.tolist()``
    threads: StepThreads | None = None  # torch's thread count per call (--torch-threads 0)

    def __init__(self, forward: LlamaForward, sampler: Sampler) -> None:
        self._forward = forward
        self._sampler = sampler
        self.cache: KVCache = forward.cache
        self.device = forward.weights.embed.device

    def compile(self, cache_folder: Path) -> None:
        """Switches to the compiled forward (``compiled.CompiledForward``) and compiles it now
        (``compiled.warm_up``), its code cached in ``cache_folder``. Logs what it compiled and
        how long it took. Raises whatever compiling raised, the eager forward still in place."""
        from app.models.hf.compiled import CompiledForward, use_cache_folder, warm_up

        use_cache_folder(cache_folder)
        compiled = CompiledForward(self._forward, cache_folder / "layers")
        warm_up(compiled)
        self._forward = compiled  # only once it runs: a failed compile leaves the eager one

    def release(self, slot: int) -> None:
        self.cache.lengths[slot] = 0

    def step(self, batch: StepBatch) -> list[int]:
        if not batch.decode_slots and not batch.prefills:
            return []
        logits, params, positions = self._run(batch)
        with torch.inference_mode():
            apply_token_masks(logits, batch.token_masks)  # structured outputs
            return self._sampler.sample(logits, params, positions)

    def step_sampled(self, batch: StepBatch) -> StepResult:
        """``step`` for a batch where some row's sampling is not plain: the logits processors
        (``logits_processors``), then the grammar's token masks, run on the sampled rows before
        the sampler; log probabilities (``app.models.hf.logprobs``) are taken after them; a
        chunk whose request asked for prompt log probabilities gets logits for its prompt
        positions too."""
        if not batch.decode_slots and not batch.prefills:
            return StepResult([])
        prompt_rows: PromptRows = []
        logits, params, positions = self._run(batch, prompt_rows)
        sampled = len(params)
        histories: list[TokenHistory | None] = list(batch.decode_histories)
        histories += [None] * (len(batch.decode_slots) - len(histories))
        histories += [c.history for c in batch.prefills if c.sample]
        with torch.inference_mode():
            rows = logits[:sampled]
            logits_processors.process(rows, params, histories)  # 1. penalties, bias, bans
            apply_token_masks(rows, batch.token_masks)  # 2. grammar token masks
            dead = _dead_rows(rows)
            tokens = self._sampler.sample(rows, params, positions)
            for i in dead:
                tokens[i] = NO_TOKEN
            wanted = [i for i, p in enumerate(params) if p.logprobs is not None and i not in dead]
            found = logprobs.entries(
                rows[wanted], [tokens[i] for i in wanted], [params[i].logprobs or 0 for i in wanted]
            )
            per_row: list[Logprobs | None] = [None] * sampled
            for i, entry in zip(wanted, found, strict=True):
                per_row[i] = entry
            prompts = _prompt_logprobs(logits[sampled:], prompt_rows)
        return StepResult(tokens, per_row, prompts or None)

    def step_logits(self, batch: StepBatch) -> torch.Tensor:
        """Runs ``batch`` exactly as ``step`` does (the cache advances) but returns the float32
        logits of its output rows instead of sampling (for tests and benchmarks)."""
        return self._run(batch)[0]

    def _run(
        self, batch: StepBatch, prompt_rows: PromptRows | None = None
    ) -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
        """One forward pass; returns the output rows' logits, sampling parameters and the
        positions the sampled tokens will take. With ``prompt_rows``, the logits of the prompt
        positions of chunks that asked for prompt log probabilities follow the sampled rows
        (in the order of the chunks appended to ``prompt_rows``)."""
        lengths = self.cache.lengths
        decode_slots = list(batch.decode_slots)
        decode_positions = [lengths[slot] for slot in decode_slots]
        for chunk in batch.prefills:
            if chunk.prefix_slot is not None:  # a fork: its prompt's cache, copied
                self._copy_prefix(chunk)
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
        scored: list[int] = []  # the prompt positions' rows, after every sampled row
        for chunk in batch.prefills:
            if prompt_rows is not None and (count := chunk.prompt_logprob_count):
                prompt_rows.append((chunk, count))
                scored.extend(range(len(tokens), len(tokens) + count))
            tokens.extend(chunk.token_ids)
            if chunk.sample:
                rows.append(len(tokens) - 1)
                params.append(chunk.sampling)
                positions.append(chunk.start + len(chunk.token_ids))
        rows += scored
        if self.threads is not None:
            self.threads.fit(len(tokens))
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

    def _copy_prefix(self, chunk: PrefillChunk) -> None:
        """Fill a fork's fresh slot with the first ``chunk.start`` positions of the slot that
        holds its prompt (``chunk.prefix_slot``), before the forward writes anything."""
        assert chunk.prefix_slot is not None
        if self.cache.lengths[chunk.slot] or len(chunk.prefix) != chunk.start:
            raise SlotStateError(
                f"slot {chunk.slot}: fork of {chunk.request_id!r} needs a released slot and "
                f"its prefix ({len(chunk.prefix)} tokens for a start at {chunk.start})"
            )
        try:
            self.cache.copy_prefix(chunk.prefix_slot, chunk.slot, chunk.start)
        except ValueError as err:
            raise SlotStateError(str(err)) from None

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


def _prompt_logprobs(
    logits: torch.Tensor, prompt_rows: PromptRows
) -> dict[str, tuple[int, list[Logprobs]]]:
    """The prompt log probabilities of ``prompt_rows``' chunks from their rows' logits."""
    out: dict[str, tuple[int, list[Logprobs]]] = {}
    row = 0
    for chunk, count in prompt_rows:
        assert chunk.history is not None
        first = chunk.start + 1
        targets = chunk.history.tokens[first : first + count]
        top = chunk.sampling.prompt_logprobs or 0
        out[chunk.request_id] = (
            first,
            logprobs.entries(logits[row : row + count], targets, [top] * count),
        )
        row += count
    return out


def _dead_rows(logits: torch.Tensor) -> list[int]:
    """The rows with no finite logit (their bans, allow-list and mask forbid every token),
    zeroed in place so the sampler draws no NaN; the caller reports ``NO_TOKEN`` for them."""
    alive = torch.isfinite(logits).any(dim=1)
    if bool(alive.all()):
        return []
    dead = (~alive).nonzero().flatten()
    logits[dead] = 0.0
    return [int(i) for i in dead.tolist()]
