"""The scheduling core: the one implementation of the slot logic.

Both the synchronous ``generate()`` and the asyncio engine drive this class; neither keeps a copy
of its rules. It is plain synchronous state with no I/O and no clock of its own (callers pass
``now``), so it is unit- and property-tested without an event loop.

A decode step is ``plan = schedule(now)`` -> run the model on ``plan.batch`` -> ``apply(plan,
tokens, now)`` (or ``fail(plan, err, now)``). ``schedule`` first refills free slots from the
waiting queue, so a slot freed by the previous step's finishes, or by an abort, is reused before
the next model call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from app.engine.slots import SlotTable
from app.engine.types import FinishReason, Sequence
from app.engine.waiting import WaitingQueue


class BatchingPolicy(StrEnum):
    """When waiting requests may enter free slots."""

    CONTINUOUS = "continuous"  # at every step boundary, into any free slot
    STATIC = "static"  # only when the whole batch is empty (the classic baseline)


@dataclass(slots=True)
class StepPlan:
    """One model call's worth of work.

    ``batch`` lists the running sequences in slot order; ``admitted`` are those that entered a
    slot in this step (a cached model must prefill them); ``released`` are the slots freed since
    the previous plan with a batch (a cached model must reset them before they are reused).
    Once the call is over: ``finished`` are the sequences it ended, ``applied`` counts the tokens
    it produced for sequences still running (not those aborted during the call), and ``error``
    is set if it failed.
    """

    batch: list[Sequence]
    admitted: list[Sequence]
    released: list[int]
    started_at: float = 0.0
    finished: list[Sequence] = field(default_factory=list)
    applied: int = 0
    error: BaseException | None = None


class Scheduler:
    """Owns the slot table and the waiting queue and makes every status change of a sequence."""

    def __init__(self, num_slots: int, policy: BatchingPolicy = BatchingPolicy.CONTINUOUS) -> None:
        self.slots = SlotTable(num_slots)
        self.waiting = WaitingQueue()
        self.policy = policy
        self._released: list[int] = []

    @property
    def num_slots(self) -> int:
        return self.slots.capacity

    def has_work(self) -> bool:
        return bool(self.waiting) or self.slots.occupied > 0

    def add(self, seq: Sequence, now: float) -> bool:
        """Queue ``seq``. Returns True if it finished at once (``max_tokens == 0``: never run)."""
        if seq.max_tokens <= 0:
            self._finish(seq, FinishReason.LENGTH, now)
            return True
        self.waiting.push(seq)
        return False

    def abort(
        self, request_id: str, now: float, reason: FinishReason = FinishReason.ABORT
    ) -> Sequence | None:
        """End a waiting or running request early, with ``reason`` (``abort``, or ``stop`` when
        a caller found a stop condition of its own, such as a stop string); its slot is free at
        once. Returns the sequence, or None if no unfinished request has this id.
        """
        seq = self.waiting.remove(request_id)
        if seq is None:
            seq = next((s for s in self.slots.running() if s.request_id == request_id), None)
        if seq is None:
            return None
        self._finish(seq, reason, now)
        return seq

    def abort_all(self, now: float) -> list[Sequence]:
        """Abort every waiting and running request (shutdown)."""
        seqs = self.waiting.drain() + list(self.slots.running())
        for seq in seqs:
            self._finish(seq, FinishReason.ABORT, now)
        return seqs

    def fail_all(self, error: BaseException, now: float) -> list[Sequence]:
        """End every waiting and running request with ``error`` (the engine is going down)."""
        seqs = self.waiting.drain() + list(self.slots.running())
        for seq in seqs:
            seq.error = error
            self._finish(seq, FinishReason.ERROR, now)
        return seqs

    def abort_waiting(self, now: float) -> list[Sequence]:
        """Abort every request still waiting for a slot (drain: no new admissions)."""
        seqs = self.waiting.drain()
        for seq in seqs:
            self._finish(seq, FinishReason.ABORT, now)
        return seqs

    def schedule(self, now: float) -> StepPlan:
        """Refill free slots from the waiting queue and return the next model call's plan."""
        admitted = self._admit(now)
        batch = self.slots.running()
        released: list[int] = []
        if batch:  # a plan with no batch is never run: keep its releases for the next model call
            released, self._released = self._released, []
        return StepPlan(batch, admitted, released, started_at=now)

    def take_released(self) -> list[int]:
        """The slots released since the last plan with a batch, handed over now instead (the
        engine goes idle, so no plan will carry them soon)."""
        released, self._released = self._released, []
        return released

    def apply(self, plan: StepPlan, tokens: Iterable[int], now: float) -> list[Sequence]:
        """Append one token per sequence of ``plan.batch``; finish those that stop or reach
        ``max_tokens`` and free their slots. Sequences aborted while the model ran are skipped.
        Returns the sequences that finished in this step (also kept in ``plan.finished``)."""
        finished = plan.finished
        skipped = 0
        for seq, token in zip(plan.batch, tokens, strict=True):
            if token not in seq.stop_token_ids and seq.finish_reason is None:
                prefix = seq.tokens
                prefix.append(token)  # the hot path: one token, not the last
                if len(prefix) >= seq.token_limit:
                    self._finish(seq, FinishReason.LENGTH, now)
                    finished.append(seq)
            elif seq.finish_reason is None:
                if seq.include_stop:
                    seq.tokens.append(token)
                self._finish(seq, FinishReason.STOP, now)
                finished.append(seq)
            else:
                skipped += 1  # aborted while the model ran: its token is dropped
        plan.applied = len(plan.batch) - skipped
        for seq in plan.admitted:  # every admitted sequence got its first token in this step
            if seq.finish_reason in (None, FinishReason.STOP, FinishReason.LENGTH):
                seq.times.first_token = now
        return finished

    def fail(self, plan: StepPlan, error: BaseException, now: float) -> list[Sequence]:
        """The model call for ``plan`` failed: end exactly its sequences with ``error``."""
        plan.error = error
        failed = [seq for seq in plan.batch if seq.finish_reason is None]
        for seq in failed:
            seq.error = error
            self._finish(seq, FinishReason.ERROR, now)
        plan.finished.extend(failed)
        return failed

    def _admit(self, now: float) -> list[Sequence]:
        room = min(len(self.waiting), self.slots.num_free)
        if not room or (self.policy is BatchingPolicy.STATIC and self.slots.occupied):
            return []
        admitted = [self.waiting.pop() for _ in range(room)]
        for seq in admitted:
            self.slots.allocate(seq)
            seq.times.admitted = now
        return admitted

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        seq.finish_reason = reason
        seq.times.finished = now
        if seq.slot is not None:
            self._released.append(self.slots.release(seq))
