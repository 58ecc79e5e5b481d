"""Turns a ``SchedulerOutput`` into one call of a model, whichever protocol it speaks, and checks
what comes back. This is the only code that talks to a model; it never changes scheduler state."""

from __future__ import annotations

import dataclasses
import logging
from itertools import compress
from operator import attrgetter, countOf
from typing import Protocol

from app.engine.errors import ModelOutputError
from app.engine.step import ModelOutput, SchedulerOutput
from app.engine.types import Sequence
from app.models.protocol import (
    NO_TOKEN,
    CachedModel,
    Logprobs,
    Model,
    PrefillChunk,
    SamplingParams,
    StatelessModel,
    StepBatch,
    StepResult,
    applies_token_masks,
    returns_int_tokens,
)

log = logging.getLogger("slotserve.engine")


class ModelRunner(Protocol):
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """Run the model once for ``out`` and return its validated tokens (one per decode
        request, then one per sampling prefill chunk)."""
        ...

    def close(self) -> None:
        """The run is over: release every slot the model still holds, so the model can serve
        another run."""
        ...

    def retry_resets(self) -> frozenset[int]:
        """Retry the slot resets that failed; return the slots still unavailable."""
        ...

    def constrained(self, out: SchedulerOutput) -> bool:
        """Whether ``execute(out)`` does grammar work (a request of ``out`` has a grammar)."""
        ...


class StatelessRunner:
    """Feeds the full token list (prompt + generated, never copied) of every request that
    samples in this step to ``next_tokens``; a partial prefill chunk needs no call (the model
    keeps nothing). With ``pad_sequence`` set, every call has exactly ``num_slots`` entries:
    empty slots carry the pad sequence and their outputs are dropped."""

    def __init__(
        self, model: StatelessModel, num_slots: int, pad_sequence: list[int] | None = None
    ) -> None:
        self.model = model
        self.num_slots = num_slots
        self.pad_sequence = pad_sequence
        self._constrained = ConstrainedRows()
        self._sampled = getattr(model, "next_tokens_for", None)
        self._ints = returns_int_tokens(model)

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        seqs, inputs, plain, sampling = out.decode_seqs, out.decode_inputs, out.decodes_plain, []
        if out.prefills:
            sampling = out.prefill_seqs  # the requests that sample: usually every chunk's
            if out.num_sampling_prefills != len(out.prefills):
                sampling = list(compress(sampling, map(_SAMPLE, out.prefills)))
            inputs = [*inputs, *map(_TOKENS, sampling)]
            plain = plain and (out.prefills_plain or all_plain(sampling))
        if not inputs:
            return ModelOutput([])
        if not plain and self._sampled is not None:
            batch = seqs + sampling
            output = model_output(self._sampled(batch), len(batch), ints=self._ints)
        elif self.pad_sequence is not None:
            output = ModelOutput(self._padded(seqs + sampling, inputs))
        else:
            tokens = self.model.next_tokens(inputs)
            output = ModelOutput(checked_tokens(tokens, len(inputs), self._ints))
        if out.decodes_constrained or out.prefills_constrained:
            rows = self._constrained.rows(out, sampling)
            output = _obeyed_output(output, rows) if rows else output
        return output

    def close(self) -> None:
        pass  # a stateless model holds nothing

    def retry_resets(self) -> frozenset[int]:
        return frozenset()  # a stateless model has no cache to reset

    def constrained(self, out: SchedulerOutput) -> bool:
        return has_constraints(out)

    def _padded(self, seqs: list[Sequence], inputs: list[list[int]]) -> list[int]:
        assert self.pad_sequence is not None
        batch = [self.pad_sequence] * self.num_slots
        slots = [seq.slot for seq in seqs]
        for slot, tokens in zip(slots, inputs, strict=True):
            assert slot is not None
            batch[slot] = tokens
        outputs = checked_tokens(self.model.next_tokens(batch), self.num_slots, self._ints)
        return [outputs[slot] for slot in slots if slot is not None]


class CachedRunner:
    """Resets released slots, then makes the model's one ``step`` call for the scheduler output.

    It tracks the slots whose cache holds something, so a call that failed part-way (a release
    never made) does not make every later call fail: only such slots are released, and a slot
    still holding a cache when a fresh chunk arrives on it is released first. A release that
    raises is logged and retried at every step; until one succeeds the slot is
    reported unavailable (the scheduler takes it out of service) and a fresh chunk scheduled on
    it is not run, so no request is ever served on a cache that was not reset.
    """

    def __init__(self, model: CachedModel) -> None:
        self.model = model
        self._assigned: set[int] = set()
        self._dirty: set[int] = set()  # assigned slots whose release raised
        self._decodes: list[Sequence] = []  # the previous step's decode list and the model-
        self._columns: tuple[list[int], list[SamplingParams], list[str]] = ([], [], [])
        self._constrained = ConstrainedRows()
        self._masks = applies_token_masks(model)
        self._sampled = getattr(model, "step_sampled", None)
        self._ints = returns_int_tokens(model)

    def _sampling_prefills(self, out: SchedulerOutput, run: list[PrefillChunk]) -> list[Sequence]:
        """The requests of the chunks in ``run`` that sample, in order (their output rows)."""
        ran = {id(chunk) for chunk in run}
        return [
            seq
            for seq, chunk in zip(out.prefill_seqs, out.prefills, strict=True)
            if chunk.sample and id(chunk) in ran
        ]

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        for slot in [*out.released, *self._dirty]:
            self._release(slot)
        for chunk in out.prefills:
            if chunk.fresh:
                self._release(chunk.slot)  # only if it still holds a cache (a missed release)
        prefills = out.prefills
        if self._dirty:  # never run a fresh chunk on a cache that could not be reset
            prefills = [c for c in prefills if not (c.fresh and c.slot in self._dirty)]
        self._assigned.update(chunk.slot for chunk in prefills if chunk.fresh)
        slots, sampling, ids = self._columns_for(out.decode_seqs)
        sampled = self._sampling_prefills(out, prefills) if prefills else []
        rows = self._constrained.rows(out, sampled)
        masks: list[bytes | None] = []
        if rows and self._masks:
            masks = [None] * (len(out.decode_seqs) + len(sampled))
            for index, seq in rows:
                masks[index] = seq.constraint.mask() if seq.constraint is not None else None
        batch = StepBatch(slots, out.decode_tokens, sampling, ids, prefills,
                          decode_histories=out.decode_seqs, token_masks=masks)  # fmt: skip
        plain = out.decodes_plain and (out.prefills_plain or all_plain(prefills))
        step = self.model.step if plain or self._sampled is None else self._sampled
        output = model_output(step(batch), batch.num_outputs, frozenset(self._dirty), self._ints)
        if masks:
            checked_masked(output.tokens, masks)
            for index, seq in rows:  # the parser's step too, here rather than on the loop
                if seq.constraint is not None and output.tokens[index] != NO_TOKEN:
                    seq.constraint.advance(output.tokens[index])
        elif rows:
            output = _obeyed_output(output, rows)
        return output

    def close(self) -> None:
        for slot in sorted(self._assigned):
            self._release(slot)

    def retry_resets(self) -> frozenset[int]:
        for slot in list(self._dirty):
            self._release(slot)
        return frozenset(self._dirty)

    def constrained(self, out: SchedulerOutput) -> bool:
        return has_constraints(out)

    def _columns_for(
        self, decodes: list[Sequence]
    ) -> tuple[list[int], list[SamplingParams], list[str]]:
        """The decode slots, sampling parameters and ids: rebuilt only when the list changes."""
        if decodes is not self._decodes:
            slots = [seq.slot for seq in decodes if seq.slot is not None]
            assert len(slots) == len(decodes), "a decoding request without a slot"
            self._decodes = decodes
            self._columns = (slots, [s.sampling for s in decodes], [s.request_id for s in decodes])
        return self._columns

    def _release(self, slot: int) -> None:
        if slot not in self._assigned:
            return
        try:
            self.model.release(slot)
        except Exception as err:
            if slot not in self._dirty:
                log.warning("the model failed to reset slot %d (retried each step): %r", slot, err)
            self._dirty.add(slot)
            return
        self._assigned.discard(slot)
        if self._dirty:
            self._dirty.discard(slot)
            log.info("slot %d was reset and is back in service", slot)


def all_plain(run: list[Sequence] | list[PrefillChunk]) -> bool:
    """Whether every one of ``run`` (the prefill rows or chunks given to the model) samples
    plainly. Read when ``SchedulerOutput.prefills_plain`` says no: that flag covers every
    chunk of the step, and a chunk the model is not given (one that samples nothing, for a
    stateless model; one skipped on a slot that failed its reset) must not keep the step off
    the model's plain call."""
    return all(map(_PLAIN, run))


def has_constraints(out: SchedulerOutput) -> bool:
    """Whether a request of ``out`` has a grammar (its work may take long: see ``Engine``)."""
    return out.decodes_constrained or out.prefills_constrained


class ConstrainedRows:
    """The output rows of a step whose request has a grammar (``Sequence.constraint``), as
    (row, request) pairs. The decode part is recomputed only when the decode list changes (the
    scheduler hands out the same list while it does not) and has such a request (the scheduler
    counts them), so a step with no constrained request looks at no request."""

    def __init__(self) -> None:
        self._decodes: list[Sequence] = []
        self._rows: list[tuple[int, Sequence]] = []

    def rows(self, out: SchedulerOutput, sampled: list[Sequence]) -> list[tuple[int, Sequence]]:
        decodes, constrained = out.decode_seqs, out.decodes_constrained
        if constrained and decodes is not self._decodes:
            self._decodes = decodes
            self._rows = [(i, seq) for i, seq in enumerate(decodes) if seq.constraint is not None]
        found = self._rows if constrained else []
        if not out.prefills_constrained:
            return found
        base = len(decodes)
        extra = [(base + i, seq) for i, seq in enumerate(sampled) if seq.constraint is not None]
        return [*found, *extra]


def obeyed(tokens: list[int], rows: list[tuple[int, Sequence]]) -> list[int]:
    """``tokens`` with each constrained row's token made to obey its grammar (for a model that
    cannot apply masks: ``TokenConstraint.choose``): a new list if any was replaced, else
    ``tokens`` itself."""
    changed: list[int] | None = None  # copied at the first replaced token (most are kept)
    for index, seq in rows:
        constraint, token = seq.constraint, tokens[index]
        if constraint is not None and token != NO_TOKEN:
            chosen = constraint.choose(token)
            if chosen != token:
                if changed is None:
                    changed = list(tokens)
                changed[index] = chosen
    return tokens if changed is None else changed


def _obeyed_output(output: ModelOutput, rows: list[tuple[int, Sequence]]) -> ModelOutput:
    """``output`` with its constrained rows' tokens made to obey their grammars (``obeyed``);
    a replaced token takes the place of the one it replaced in that row's log probabilities,
    so the reported token is still the most likely (the mocks' synthetic distribution)."""
    tokens = obeyed(output.tokens, rows)
    if tokens is output.tokens:
        return output
    logprobs = output.logprobs
    if logprobs is not None:
        logprobs = list(logprobs)
        for index, _ in rows:
            old, new, entry = output.tokens[index], tokens[index], logprobs[index]
            if entry is not None and old != new:
                swap = {old: new, new: old}
                top = tuple((swap.get(t, t), lp) for t, lp in entry.top)
                logprobs[index] = Logprobs(new, entry.logprob, top)
    return dataclasses.replace(output, tokens=tokens, logprobs=logprobs)


def checked_masked(tokens: list[int], masks: list[bytes | None]) -> list[int]:
    """``tokens``, or ``ModelOutputError`` if a masked row's token is not allowed by its mask."""
    for index, (token, mask) in enumerate(zip(tokens, masks, strict=True)):
        if (
            mask is not None
            and token != NO_TOKEN
            and not (token >> 3 < len(mask) and mask[token >> 3] >> (token & 7) & 1)
        ):
            raise ModelOutputError(
                f"model sampled token {token} at row {index}, which its mask forbids"
            )
    return tokens


def close_quietly(runner: ModelRunner) -> None:
    """``runner.close()``, logging a failure instead of raising it: a model that cannot release
    its slots must not hide a run's results or the error that ended it, nor stop a shutdown.
    The runner releases a slot again before reusing it."""
    try:
        runner.close()
    except Exception:
        log.exception("the model failed to release its slots")


def make_runner(model: Model, num_slots: int, pad_sequence: list[int] | None = None) -> ModelRunner:
    """The runner for ``model``'s protocol (a cached model is preferred when it speaks both)."""
    if isinstance(model, CachedModel):
        if pad_sequence is not None:
            raise ValueError("a fixed batch shape (pad_sequence) applies to stateless models only")
        return CachedRunner(model)
    if isinstance(model, StatelessModel):
        return StatelessRunner(model, num_slots, pad_sequence)
    raise TypeError(f"{type(model).__name__} has neither next_tokens() nor step() and release()")


_TOKENS, _SAMPLE, _PLAIN = attrgetter("tokens"), attrgetter("sample"), attrgetter("sampling.plain")


def model_output(
    result: object, expected: int, unavailable: frozenset[int] = frozenset(), ints: bool = False
) -> ModelOutput:
    """A model's answer (a token list or a ``StepResult``) checked and wrapped (``ints``: the
    model promises int tokens, see ``checked_tokens``)."""
    if not isinstance(result, StepResult):
        return ModelOutput(checked_tokens(result, expected, ints), unavailable)
    tokens = checked_tokens(result.tokens, expected, ints)
    logprobs = result.logprobs
    if logprobs is not None and len(logprobs) != expected:
        raise ModelOutputError(f"model returned {len(logprobs)} logprobs, expected {expected}")
    return ModelOutput(tokens, unavailable, logprobs, result.prompt_logprobs)


def checked_tokens(tokens: object, expected: int, ints: bool = False) -> list[int]:
    """``tokens`` as a list of ``expected`` ints, or ``ModelOutputError`` saying what is wrong.
    With ``ints`` (the model promises ints: ``returns_int_tokens``) their types are not looked
    at, only the container and the count."""
    if not isinstance(tokens, (list, tuple)):  # a tuple: quicker than list | tuple
        raise ModelOutputError(f"model returned {type(tokens).__name__}, expected a list of ints")
    if len(tokens) != expected:
        raise ModelOutputError(f"model returned {len(tokens)} tokens, expected {expected}")
    if not ints and countOf(map(type, tokens), int) != expected:  # one C pass; bool is no int
        i, token = next((i, t) for i, t in enumerate(tokens) if type(t) is not int)
        raise ModelOutputError(
            f"model returned {token!r} ({type(token).__name__}) at index {i}, expected int"
        )
    return list(tokens) if isinstance(tokens, tuple) else tokens
