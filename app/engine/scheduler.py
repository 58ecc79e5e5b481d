"""The scheduling core: the one implementation of the slot logic.

Both the synchronous ``generate()`` and the asyncio engine drive this class; neither keeps a copy
of its rules. It is plain synchronous state with no I/O and no clock of its own (callers pass
``now``), so it is unit- and property-tested without an event loop. It makes every status change
of a request.

A step is ``out = schedule(now)`` -> one model call for ``out`` -> ``update(out, model_output,
now)`` (or ``fail(out, error, now)``). ``schedule`` spends the step's token budget in this
order: one token for every decoding request, then prompt chunks of requests still prefilling
(oldest admission first), then new admissions from the waiting queue into free slots, so a slot
freed by the previous step, or by an abort, is reused before the next model call and a long
prompt is prefilled over several steps while everyone else keeps decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from app.engine.kv_books import KVBooks
from app.engine.slots import SlotTable
from app.engine.step import ModelOutput, SchedulerOutput, StepOutcome
from app.engine.types import FinishReason, RequestStatus, Sequence
from app.engine.waiting import WaitingQueue
from app.models.protocol import PrefillChunk

UNBOUNDED = 1 << 62  # a token budget or KV capacity that never binds


class BatchingPolicy(StrEnum):
    """When waiting requests may enter free slots."""

    CONTINUOUS = "continuous"  # at every step boundary, into any free slot
    STATIC = "static"  # only when the whole batch is empty (the classic baseline)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's limits.

    ``max_num_batched_tokens``: tokens fed per step in all (None: no limit, so every prompt is
    prefilled in one step); it must be >= ``num_slots`` so every running request decodes every
    step. ``max_prefill_chunk``: prompt tokens one request may be fed in one step (None: the
    budget). ``kv_cache_tokens``: KV capacity in tokens, rounded down to whole blocks of
    ``block_size`` (None: it never binds). ``max_model_len``: the longest a request can get
    (the API enforces it); a capacity of ``num_slots * max_model_len`` or more never binds
    either, so the scheduler skips the block arithmetic.
    """

    num_slots: int
    policy: BatchingPolicy = BatchingPolicy.CONTINUOUS
    max_num_batched_tokens: int | None = None
    max_prefill_chunk: int | None = None
    block_size: int = 16
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None

    @property
    def kv_binds(self) -> bool:
        """Whether the KV capacity can ever stop a request from running."""
        kv, longest = self.kv_cache_tokens, self.max_model_len
        return kv is not None and (longest is None or kv < self.num_slots * longest)

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        budget = self.max_num_batched_tokens
        if budget is not None and budget < self.num_slots:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= num_slots ({self.num_slots}), "
                "so every running request decodes every step"
            )
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {self.max_prefill_chunk}")


class Scheduler:
    """Owns the slot table, the waiting queue and the KV books, and makes every status change
    of a request: admitted, prefilled, decoded, preempted, resumed, finished."""

    def __init__(self, config: SchedulerConfig | int, policy: BatchingPolicy | None = None) -> None:
        if isinstance(config, int):
            config = SchedulerConfig(config, policy or BatchingPolicy.CONTINUOUS)
        self.config = config
        self.slots = SlotTable(config.num_slots)
        self.waiting = WaitingQueue()
        self.books = KVBooks(config.kv_cache_tokens or UNBOUNDED, config.block_size)
        self._budget = config.max_num_batched_tokens or UNBOUNDED
        self._chunk_cap = config.max_prefill_chunk or self._budget
        self._prefilling: list[Sequence] = []  # running, prefill incomplete, admission order
        self._decoding: list[Sequence] | None = []  # running past prefill, slot order (cached)
        self._released: list[int] = []
        self._preempted: list[Sequence] = []
        self._free_blocks = UNBOUNDED  # while planning a step: blocks not yet handed out
        self._admissions = 0

    @property
    def num_slots(self) -> int:
        return self.slots.capacity

    @property
    def policy(self) -> BatchingPolicy:
        return self.config.policy

    def has_work(self) -> bool:
        return bool(self.waiting) or self.slots.occupied > 0

    # --- arrivals and early ends ------------------------------------------------------------

    def add(self, seq: Sequence, now: float) -> bool:
        """Queue ``seq``. Returns True if it finished at once (``max_tokens == 0``: never run)."""
        if seq.max_tokens <= 0:
            self._finish(seq, FinishReason.LENGTH, now)
            return True
        seq.status = RequestStatus.WAITING
        self.waiting.push(seq)
        return False

    def abort(
        self, request_id: str, now: float, reason: FinishReason = FinishReason.ABORT
    ) -> Sequence | None:
        """End a waiting, preempted or running request early, with ``reason``; its slot is free
        at once. Returns the sequence, or None if no unfinished request has this id."""
        seq = self.waiting.remove(request_id)
        if seq is None:
            seq = next((s for s in self.slots.running() if s.request_id == request_id), None)
        if seq is None:
            return None
        self._finish(seq, reason, now)
        return seq

    def abort_all(self, now: float) -> list[Sequence]:
        """Abort every waiting and running request (shutdown)."""
        return self._end_all(self.waiting.drain() + list(self.slots.running()), now, None)

    def fail_all(self, error: BaseException, now: float) -> list[Sequence]:
        """End every waiting and running request with ``error`` (the engine is going down)."""
        return self._end_all(self.waiting.drain() + list(self.slots.running()), now, error)

    def abort_waiting(self, now: float) -> list[Sequence]:
        """Abort every request still waiting for a slot (drain: no new admissions)."""
        return self._end_all(self.waiting.drain(), now, None)

    def preempt(self, seq: Sequence, now: float) -> None:
        """Take a running request off its slot: the slot is released (its cache reset), its
        blocks freed, and it goes back to the front of the queue. When it gets a slot again,
        its prompt and generated tokens are recomputed (chunked and counted as prefill) and it
        goes on where it stopped: its stream sees no token twice and none missing."""
        if seq.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {seq.request_id!r} is not running")
        self._requeue(seq, RequestStatus.PREEMPTED)
        seq.num_preemptions += 1
        self._preempted.append(seq)

    # --- the step ---------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Plan the next step within the token budget and the KV capacity (see the module
        docstring for the order)."""
        decoding = self._decodes_that_fit(now)
        out = SchedulerOutput(decoding, started_at=now)
        budget = self._budget - len(decoding)
        for seq in self._prefilling:
            budget -= self._chunk(out, seq, budget)
        budget = self._admit(out, budget, now)
        while out.empty and len(self._prefilling) > 1:  # prefills that filled the cache
            self._preempt_youngest_prefill(now)
            for seq in self._prefilling:
                budget -= self._chunk(out, seq, budget)
        out.preempted, self._preempted = self._preempted, []
        if not out.empty:  # an empty output is never run: keep its releases for the next one
            out.released, self._released = self._released, []
        return out

    def take_released(self) -> list[int]:
        """The slots released since the last step that ran, handed over now instead (the engine
        goes idle, so no step will carry them soon)."""
        released, self._released = self._released, []
        return released

    def update(self, out: SchedulerOutput, result: ModelOutput, now: float) -> StepOutcome:
        """Apply the model's tokens for ``out``: advance every request's computed tokens, append
        each sampled token, finish requests that stop or reach ``max_tokens`` (their slots are
        free for the next ``schedule``). Requests aborted or preempted during the call are
        skipped and their tokens dropped (a preempted one recomputes them when it resumes)."""
        tokens = result.tokens
        expected = out.num_outputs
        if result.unavailable_slots:
            expected -= sum(1 for c in out.prefills if c.sample and not result.ran(c))
        if len(tokens) != expected:
            raise ValueError(f"{len(tokens)} tokens for a step that samples {expected}")
        outcome = StepOutcome(out, now)
        outcome.num_decode_generated = self._apply_decodes(out.decode_seqs, tokens, outcome)
        self._apply_prefills(out, result, outcome)
        self.slots.set_out_of_service(result.unavailable_slots)
        return outcome

    def fail(self, out: SchedulerOutput, error: BaseException, now: float) -> StepOutcome:
        """The model call for ``out`` failed: end exactly its requests with ``error``."""
        outcome = StepOutcome(out, now, error=error)
        outcome.finished = self._end_all(
            [seq for seq in out.scheduled() if seq.status is RequestStatus.RUNNING], now, error
        )
        return outcome

    # --- inside a step ----------------------------------------------------------------------

    def _decoding_now(self) -> list[Sequence]:
        if self._decoding is None:
            self._decoding = [s for s in self.slots.running() if not s.prefilling]
        return self._decoding

    def _decodes_that_fit(self, now: float) -> list[Sequence]:
        """The decoding requests, with the blocks their tokens need set aside. When the cache
        cannot take one more token for each, preempt the most recently admitted running
        requests until it can (as vLLM does)."""
        decoding = self._decoding_now()
        if not self.config.kv_binds:
            self._free_blocks = UNBOUNDED
            return decoding
        books = self.books
        while True:
            free = books.total - books.used(self.slots.running())
            # a decode needs a new block when its cached tokens fill their blocks exactly
            needed = sum(1 for s in decoding if s.num_computed_tokens % books.block_size == 0)
            if needed <= free or not decoding:
                self._free_blocks = free - needed
                return decoding
            self.preempt(max(self.slots.running(), key=lambda s: s.admission), now)
            decoding = self._decoding_now()

    def _preempt_youngest_prefill(self, now: float) -> None:
        """Running requests are all prefilling and none has the blocks for its next chunk:
        give the most recently admitted one's blocks to the others."""
        victim = max(self._prefilling, key=lambda s: s.admission)
        self._free_blocks += self.books.blocks_for(victim.num_computed_tokens)
        self.preempt(victim, now)

    def _chunk(self, out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        """Schedule the next prefill chunk of ``seq`` within ``budget``; returns its length."""
        start, books = seq.prefilled, self.books
        room = books.room(start, self._free_blocks)
        size = min(seq.prefill_target - start, self._chunk_cap, budget, room)
        if size <= 0:
            return 0
        self._free_blocks -= books.blocks_for(start + size) - books.blocks_for(start)
        sample = start + size == seq.prefill_target
        assert seq.slot is not None
        chunk = PrefillChunk(seq.slot, seq.tokens[start : start + size], start, sample,
                             seq.sampling, seq.request_id)  # fmt: skip
        out.prefill_seqs.append(seq)
        out.prefills.append(chunk)
        out.num_prefill_tokens += size
        return size

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Move waiting requests into free slots while the budget and the cache allow."""
        if self.policy is BatchingPolicy.STATIC and self.slots.occupied:
            return budget
        while budget > 0 and self.waiting and self.slots.num_free:
            seq = self.waiting.peek()
            if not self.books.room(0, self._free_blocks):
                break  # the cache is full: it waits (first come, first served)
            self.waiting.pop()
            self.slots.allocate(seq)
            seq.status = RequestStatus.RUNNING
            seq.prefilled, seq.prefill_target = 0, len(seq.tokens)
            self._admissions += 1
            seq.admission = self._admissions
            if seq.times.admitted is None:  # its first admission (not a resume)
                seq.times.admitted = now
                out.admitted.append(seq)
            else:
                out.resumed.append(seq)
            self._prefilling.append(seq)
            budget -= self._chunk(out, seq, budget)
        return budget

    def _apply_decodes(self, seqs: list[Sequence], tokens: list[int], outcome: StepOutcome) -> int:
        """The hot path: one token for each decoding request. Returns the tokens applied."""
        finished, now, running = outcome.finished, outcome.ended_at, RequestStatus.RUNNING
        skipped = 0
        for seq, token in zip(seqs, tokens, strict=False):
            if seq.status is not running:
                skipped += 1  # aborted or preempted while the model ran: its token is dropped
            elif token in seq.stop_token_ids:
                self._stop(seq, token, now, finished)
            else:
                prefix = seq.tokens
                prefix.append(token)  # one token, not the last: the request has computed it
                if len(prefix) >= seq.token_limit:
                    self._finish(seq, FinishReason.LENGTH, now)
                    finished.append(seq)
                elif seq.stop is not None and seq.stop.feed([token]):
                    self._finish(seq, FinishReason.STOP, now)
                    finished.append(seq)
        applied = len(seqs) - skipped
        outcome.num_generated += applied
        return applied

    def _apply_prefills(
        self, out: SchedulerOutput, result: ModelOutput, outcome: StepOutcome
    ) -> None:
        tokens, index, now = result.tokens, len(out.decode_seqs), outcome.ended_at
        for seq, chunk in zip(out.prefill_seqs, out.prefills, strict=True):
            if not result.ran(chunk):  # its slot could not be reset: back to the queue
                if seq.status is RequestStatus.RUNNING:
                    self._requeue(seq, RequestStatus.WAITING)
                    seq.times.admitted = None
                continue
            token = tokens[index] if chunk.sample else None
            index += chunk.sample
            if seq.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the model ran
            seq.prefilled = chunk.start + len(chunk.token_ids)
            if token is None:
                continue
            self._prefilling.remove(seq)
            self._decoding = None  # it decodes from the next step on
            outcome.num_generated += 1
            if seq.times.first_token is None:
                seq.times.first_token = now
            self._append(seq, token, now, outcome.finished)

    def _append(self, seq: Sequence, token: int, now: float, finished: list[Sequence]) -> None:
        if token in seq.stop_token_ids:
            self._stop(seq, token, now, finished)
            return
        seq.tokens.append(token)
        if len(seq.tokens) >= seq.token_limit:
            self._finish(seq, FinishReason.LENGTH, now)
            finished.append(seq)
        elif seq.stop is not None and seq.stop.feed([token]):
            self._finish(seq, FinishReason.STOP, now)
            finished.append(seq)

    def _stop(self, seq: Sequence, token: int, now: float, finished: list[Sequence]) -> None:
        if seq.include_stop:
            seq.tokens.append(token)
        self._finish(seq, FinishReason.STOP, now)
        finished.append(seq)

    # --- ends -------------------------------------------------------------------------------

    def _end_all(
        self, seqs: list[Sequence], now: float, error: BaseException | None
    ) -> list[Sequence]:
        for seq in seqs:
            seq.error = error
            self._finish(seq, FinishReason.ABORT if error is None else FinishReason.ERROR, now)
        return seqs

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        if seq.status is RequestStatus.RUNNING:
            self._leave_slot(seq)
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason
        seq.times.finished = now

    def _requeue(self, seq: Sequence, status: RequestStatus) -> None:
        """Back to the front of the queue, to be recomputed from position 0."""
        self._leave_slot(seq)
        seq.status = status
        self.waiting.push_front(seq)

    def _leave_slot(self, seq: Sequence) -> None:
        """``seq`` gives up its slot and its blocks."""
        if seq.prefilling:
            self._prefilling.remove(seq)
        else:
            self._decoding = None
        self._released.append(self.slots.release(seq))
        seq.prefilled = 0
