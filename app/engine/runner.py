"""Turns a ``StepPlan`` into one call of a model, whichever protocol it speaks, and checks what
comes back. This is the only code that talks to a model; it never changes scheduler state."""

from __future__ import annotations

import logging
from typing import Protocol

from app.engine.errors import ModelOutputError
from app.engine.scheduler import StepPlan
from app.engine.types import Sequence
from app.models.latency import STEP_STARTED
from app.models.protocol import CachedModel, Model, StatelessModel

log = logging.getLogger("slotserve.engine")


class ModelRunner(Protocol):
    def execute(self, plan: StepPlan) -> list[int]:
        """Run the model for ``plan`` and return one validated token per ``plan.batch`` entry."""
        ...

    def close(self) -> None:
        """The run is over: release every slot the model still holds, so the model can serve
        another run."""
        ...


class StatelessRunner:
    """Feeds each running sequence's token list (prompt + generated, never copied) to
    ``next_tokens``. With ``pad_sequence`` set, every call has exactly ``num_slots`` entries:
    empty slots carry the pad sequence and their outputs are dropped."""

    def __init__(
        self, model: StatelessModel, num_slots: int, pad_sequence: list[int] | None = None
    ) -> None:
        self.model = model
        self.num_slots = num_slots
        self.pad_sequence = pad_sequence
        self._batch: list[Sequence] = []  # the previous call's batch and its inputs: while the
        self._inputs: list[list[int]] = []  # slot table is unchanged, the same lists serve again

    def execute(self, plan: StepPlan) -> list[int]:
        reset = STEP_STARTED.set(plan.started_at)
        try:
            if self.pad_sequence is None:
                inputs = self._inputs_for(plan.batch)
                return checked_tokens(self.model.next_tokens(inputs), len(inputs))
            return self._execute_padded(plan)
        finally:
            STEP_STARTED.reset(reset)

    def close(self) -> None:
        self._batch, self._inputs = [], []

    def _inputs_for(self, batch: list[Sequence]) -> list[list[int]]:
        if batch is not self._batch:
            self._batch, self._inputs = batch, [seq.tokens for seq in batch]
        return self._inputs

    def _execute_padded(self, plan: StepPlan) -> list[int]:
        assert self.pad_sequence is not None
        inputs = [self.pad_sequence] * self.num_slots
        for seq in plan.batch:
            assert seq.slot is not None
            inputs[seq.slot] = seq.tokens
        outputs = checked_tokens(self.model.next_tokens(inputs), self.num_slots)
        return [outputs[seq.slot] for seq in plan.batch if seq.slot is not None]


class CachedRunner:
    """Resets released slots, prefills admitted ones, then decodes every running slot.

    It tracks the slots it has assigned, so a call that failed part-way (a request admitted but
    never assigned, a release never made) does not make every later call fail: only assigned
    slots are released, and a slot still assigned when it is handed to a new request is released
    first.
    """

    def __init__(self, model: CachedModel) -> None:
        self.model = model
        self._assigned: set[int] = set()

    def execute(self, plan: StepPlan) -> list[int]:
        reset = STEP_STARTED.set(plan.started_at)
        try:
            for slot in plan.released:
                self._release(slot)
            admitted = {id(seq) for seq in plan.admitted}
            for seq in plan.admitted:
                assert seq.slot is not None
                self._release(seq.slot)
                self.model.assign(seq.slot, seq.prompt)
                self._assigned.add(seq.slot)
            slots = [seq.slot for seq in plan.batch if seq.slot is not None]
            last = [None if id(seq) in admitted else seq.tokens[-1] for seq in plan.batch]
            return checked_tokens(self.model.decode(slots, last), len(plan.batch))
        finally:
            STEP_STARTED.reset(reset)

    def close(self) -> None:
        for slot in sorted(self._assigned):
            self._release(slot)

    def _release(self, slot: int) -> None:
        if slot in self._assigned:
            self._assigned.discard(slot)
            self.model.release(slot)


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
    raise TypeError(f"{type(model).__name__} has neither next_tokens() nor assign/release/decode")


_INT_ONLY = {int}


def checked_tokens(tokens: object, expected: int) -> list[int]:
    """``tokens`` as a list of ``expected`` ints, or ``ModelOutputError`` saying what is wrong."""
    if not isinstance(tokens, (list, tuple)):  # a tuple: quicker than list | tuple
        raise ModelOutputError(f"model returned {type(tokens).__name__}, expected a list of ints")
    if len(tokens) != expected:
        raise ModelOutputError(f"model returned {len(tokens)} tokens, expected {expected}")
    if expected and set(map(type, tokens)) != _INT_ONLY:  # one C-level pass; bool is not int
        i, token = next((i, t) for i, t in enumerate(tokens) if type(t) is not int)
        raise ModelOutputError(
            f"model returned {token!r} ({type(token).__name__}) at index {i}, expected int"
        )
    return list(tokens) if isinstance(tokens, tuple) else tokens
