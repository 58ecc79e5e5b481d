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

Which waiting request is admitted, and whether a running one is preempted for it, is the
scheduling policy's choice (``app/engine/policies.py``); under ``fcfs`` (no policy object) the
queue is served in order and nothing is preempted but for the KV cache.

With the prefix cache on, an admitted request starts after its prompt's cached leading blocks:
its first chunk starts there (carrying the cached tokens as ``prefix`` for the model), so the
step clock charges prefill only for the rest.

A request's ``n`` choices prefill their prompt once: every choice but the first is a *fork*
(``Sequence.fork_of``). It waits in the queue, passed over, while the first choice prefills;
once that one decodes, the fork is admitted with every prompt position but the last copied
from the first choice's slot (``PrefillChunk.prefix_slot``) and is fed only the last one, which
it samples from with its own seed. A fork that cannot be made (the first choice has ended or
stops at its first token, the fork asks for prompt log probabilities) prefills on its own,
losing nothing but time.
"""

from __future__ import annotations

from bisect import bisect, bisect_left
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from heapq import heapify, heappop, heappush
from operator import attrgetter, countOf

from app.engine.errors import NoTokenLeftError
from app.engine.kv_books import KVBooks
from app.engine.policies import FCFS, Policy, PolicyConfig, make_policy
from app.engine.prefix_cache import CachedBlock, PrefixCache
from app.engine.slots import SlotTable
from app.engine.step import ModelOutput, SchedulerOutput, StepOutcome
from app.engine.types import (
    FINISHED,
    PREEMPTED,
    REASON_LENGTH,
    REASON_STOP,
    RUNNING,
    WAITING,
    FinishReason,
    RequestStatus,
    Sequence,
)
from app.engine.waiting import WaitingQueue
from app.kv_transfer.holds import DEFAULT_HOLD_SECONDS, Held, Holds
from app.models.protocol import NO_TOKEN, Logprobs, PrefillChunk

UNBOUNDED = 1 << 62  # a token budget or KV capacity that never binds
_admission = attrgetter("admission")
_APPEND = list.append
_consume = deque[None](maxlen=0).extend  # runs an iterator to its end at C speed


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
    either, so the scheduler skips the block arithmetic. ``batching``: continuous or static;
    ``policy``: the scheduling policy.
    ``enable_prefix_caching``: keep the full prompt blocks of requests in a prefix cache
    (``app.engine.prefix_cache``) and start each admitted request after its cached prefix.
    """

    num_slots: int
    batching: BatchingPolicy = BatchingPolicy.CONTINUOUS
    max_num_batched_tokens: int | None = None
    max_prefill_chunk: int | None = None
    block_size: int = 16
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None
    policy: PolicyConfig = FCFS
    enable_prefix_caching: bool = False
    record_kv_events: bool = False  # the prefix cache logs its changes (KV events)
    # LoRA: at most this many distinct adapters among the running requests (None: no rule).
    # A waiting request whose adapter would exceed it waits; requests behind it that fit go
    # first (vLLM's rule).
    max_loras: int | None = None
    # n > 1: a request with ``fork_of`` set starts from a copy of that request's prompt cache
    # (the model must share prompts: ``app.models.protocol.shares_prompts``); False: it
    # prefills its prompt alone
    share_prompts: bool = False
    # prefill/decode disaggregation: how long a finished ``remote_decode`` request's blocks
    # are held for the remote decoder's pull (app/kv_transfer/holds.py)
    kv_hold_seconds: float = DEFAULT_HOLD_SECONDS

    @property
    def kv_binds(self) -> bool:
        """Whether the KV capacity can ever stop a request from running (compared in whole
        blocks: a full slot holds ``ceil(max_model_len / block_size)`` of them)."""
        kv, longest, size = self.kv_cache_tokens, self.max_model_len, self.block_size
        if kv is None:
            return False
        return longest is None or kv // size < self.num_slots * -(-longest // size)

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
        if not isinstance(self.batching, BatchingPolicy) or not isinstance(
            self.policy, PolicyConfig
        ):
            raise TypeError("batching is a BatchingPolicy and policy a PolicyConfig")


class Scheduler:
    """Owns the slot table, the waiting queue and the KV books, and makes every status change
    of a request: admitted, prefilled, decoded, preempted, resumed, finished."""

    def __init__(
        self, config: SchedulerConfig | int, batching: BatchingPolicy | None = None
    ) -> None:
        if isinstance(config, int):
            config = SchedulerConfig(config, batching or BatchingPolicy.CONTINUOUS)
        self.config = config
        self.slots = SlotTable(config.num_slots)
        self.waiting = WaitingQueue()
        self.prefix_cache = (
            PrefixCache(config.block_size, config.record_kv_events)
            if config.enable_prefix_caching
            else None
        )
        self.books = KVBooks(
            config.kv_cache_tokens or UNBOUNDED, config.block_size, self.prefix_cache
        )
        # finished prefills' blocks kept for a remote decoder (prefill/decode disaggregation)
        self.holds = Holds(self.books.total, config.kv_hold_seconds)
        self.books.holds = self.holds
        self._count_blocks = config.kv_binds or self.prefix_cache is not None
        self._static = config.batching is BatchingPolicy.STATIC
        self._budget = config.max_num_batched_tokens or UNBOUNDED
        self._chunk_cap = config.max_prefill_chunk or self._budget
        self._prefilling: list[Sequence] = []  # running, prefill incomplete, admission order
        # running past prefill, in slot order, and their token lists in the same order (the
        # stateless runner's inputs); how many of them sample other than plainly, or have a
        # grammar. Once a plan carries the two lists (``_decoding_planned``) they are never
        # modified: the first change after that copies them (copy on write, once a step)
        self._decoding: list[Sequence] = []
        self._decoding_tokens: list[list[int]] = []
        self._decoding_slots: list[int] = []  # their slots (never handed out: changed in place)
        self._decoding_planned = False
        self._unplain = self._constrained = 0
        # for ``_apply_decodes``' C-speed path: how many decodes keep a step off it (they need
        # the end rules for every token, or have another stop set than the first decode's,
        # ``_stops``); the updates so far; a heap of (the update at which a decode reaches its
        # last token, its admission, it)
        self._off_fast_path = self._updates = 0
        self._stops: frozenset[int] = frozenset()
        self._deadlines: list[tuple[int, int, Sequence]] = []
        self._released: list[int] = []
        self._preempted: list[Sequence] = []
        self._free_blocks = UNBOUNDED  # while planning a step: blocks not yet handed out
        self._admissions = 0
        self._unstarted: set[str] = set()  # admitted, no chunk scheduled on the fresh slot yet
        # LoRA adapters in the batch's adapter slots (``max_loras`` of them), least recently
        # admitted first: admitting a request whose adapter is not there loads it (counted in
        # ``SchedulerOutput.lora_loads``, charged by the step clock)
        self._lora_slots: dict[str, None] = {}
        self.policy: Policy | None = make_policy(config.policy)

    @property
    def num_slots(self) -> int:
        return self.slots.capacity

    @property
    def batching(self) -> BatchingPolicy:
        """The batching mode (continuous or static); ``policy`` is the scheduling policy."""
        return self.config.batching

    def has_work(self) -> bool:
        return bool(self.waiting) or self.slots.occupied > 0

    # --- arrivals and early ends ------------------------------------------------------------

    def add(self, seq: Sequence, now: float) -> bool:
        """Queue ``seq``. Returns True if it finished at once: ``max_tokens == 0`` (never run,
        ``length``) or too long for the whole KV cache (``error``)."""
        if seq.max_tokens <= 0 and seq.prompt_logprobs is None:
            set_status(seq, FINISHED, FinishReason.LENGTH, now)  # (with prompt
            return True  # log probabilities it runs for its prefill)
        if self._count_blocks and not self.books.fits_ever(seq.token_limit - 1):
            seq.error = ValueError(
                f"request {seq.request_id!r} needs up to {seq.token_limit - 1} tokens of KV "
                f"cache; the cache holds {self.books.capacity_tokens}"
            )
            set_status(seq, FINISHED, FinishReason.ERROR, now)
            return True
        if seq.fork_of is not None and not self._may_fork(seq, seq.fork_of):
            seq.fork_of = None
        if seq.status is not WAITING:  # (a new request already is: the default status)
            set_status(seq, WAITING)
        self.waiting.push(seq)
        if self.policy is not None:
            self.policy.on_queued(seq, now, new=True)
        return False

    def _may_fork(self, seq: Sequence, source: Sequence) -> bool:
        """Whether ``seq`` may start from ``source``'s prompt cache: forking is on, ``source``
        is one of this scheduler's live requests with the same prompt and adapter that will
        decode (``max_tokens`` > 1), and ``seq`` needs no prompt log probabilities (they need
        every prompt position computed)."""
        live = self.waiting.get(source.request_id) is source or (
            source.slot is not None and self.slots.get(source.slot) is source
        )
        return (
            self.config.share_prompts
            and self.batching is BatchingPolicy.CONTINUOUS  # static: it would wait a whole batch
            and live
            and seq.prompt_logprobs is None
            and seq.num_generated == 0
            and source.max_tokens > 1  # else it ends at its first token: nothing to fork from
            and 1 < seq.prompt_len == source.prompt_len
            and seq.lora == source.lora
            and source.tokens[: source.prompt_len] == seq.tokens
        )

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

    def fail_waiting(self, error: BaseException, now: float) -> list[Sequence]:
        """End every request waiting for a slot with ``error``."""
        return self._end_all(self.waiting.drain(), now, error)

    def abort_waiting(self, now: float) -> list[Sequence]:
        """Abort every request still waiting for a slot (drain: no new admissions), but the
        forks of a running request (``fork_of``): they belong to a request that runs, which
        may finish within the drain's grace."""
        queued = self.waiting.drain()
        for seq in queued:
            if _forks_a_running_request(seq):
                self.waiting.push(seq)
        ended = [seq for seq in queued if seq.request_id not in self.waiting]
        return self._end_all(ended, now, None)

    def preempt(self, seq: Sequence, now: float) -> None:
        """Take a running request off its slot: the slot is released (its cache reset), its
        blocks freed, and it goes back to the front of the queue. When it gets a slot again,
        its prompt and generated tokens are recomputed (chunked and counted as prefill) and it
        goes on where it stopped: its stream sees no token twice and none missing."""
        if seq.status is not RUNNING:
            raise ValueError(f"request {seq.request_id!r} is not running")
        if self.policy is not None:
            self.policy.on_preempted(seq, now)
        self._requeue(seq, PREEMPTED, now)
        seq.num_preemptions += 1
        self._preempted.append(seq)

    # --- the step ---------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Plan the next step within the token budget and the KV capacity (see the module
        docstring for the order). A policy may first preempt one running request for a waiting
        one, when every slot is busy."""
        policy = self.policy
        if self.holds.by_id:  # (no call in the usual step: nothing is held)
            self.holds.expire(now)
        if policy is not None and self.waiting.by_id and not self.slots.free:
            self._preempt_for_waiting(policy, now)
        if self._count_blocks:
            decoding = self._decodes_that_fit(now)
        else:  # the cache never binds
            decoding, self._free_blocks = self._decoding, UNBOUNDED
        out = SchedulerOutput(
            decoding, self._decoding_tokens, now, not self._unplain, self._constrained > 0
        )
        self._decoding_planned = True
        budget = self._budget - len(decoding)
        budget = self._chunk_prefills(out, budget) if self._prefilling else budget
        if self.waiting.by_id and self.slots.free:  # (no Python call: they run every step)
            budget = self._admit(out, budget, now)
        while len(self._prefilling) > 1 and out.empty:  # prefills that filled the cache
            self._preempt_youngest_prefill(now)
            budget = self._chunk_prefills(out, budget)
        if self.prefix_cache is not None:  # the blocks handed out come from the free ones
            self.prefix_cache.evict_to(self._free_blocks)
        if self._preempted:
            out.preempted, self._preempted = self._preempted, []
        if policy is not None and policy.charges:
            policy.charge(out)
        if self._released and (out.decode_seqs or out.prefills):  # an empty output is never
            out.released, self._released = self._released, []  # run: keep its releases
        return out

    def release_held(self, request_id: str, now: float) -> Held | None:
        """A remote decoder pulled ``request_id``'s held blocks: they are free now. None if
        they are not held (never, pulled already, or expired by ``now``)."""
        self.holds.expire(now)
        return self.holds.take(request_id)

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
        tokens, unavailable = result.tokens, result.unavailable_slots
        expected = len(out.decode_seqs) + out.num_sampling_prefills  # (``out.num_outputs``)
        if unavailable:
            expected -= sum(1 for c in out.prefills if c.sample and not result.ran(c))
        if len(tokens) != expected:
            raise ValueError(f"{len(tokens)} tokens for a step that samples {expected}")
        outcome = StepOutcome(out, now)
        self._updates += 1
        outcome.num_decode_generated = self._apply_decodes(out, tokens, outcome, result.logprobs)
        if out.prefills:
            self._apply_prefills(out, result, outcome)
        if unavailable or self.slots.out_of_service:  # (the usual step: neither)
            self.slots.set_out_of_service(unavailable)
        return outcome

    def fail(self, out: SchedulerOutput, error: BaseException, now: float) -> StepOutcome:
        """The model call for ``out`` failed: end exactly its requests with ``error``."""
        outcome = StepOutcome(out, now, error=error)
        outcome.finished = self._end_all(
            [seq for seq in out.scheduled() if seq.status is RUNNING], now, error
        )
        return outcome

    # --- inside a step ----------------------------------------------------------------------

    def _start_decoding(self, seq: Sequence) -> None:
        """``seq`` is past its prefill: it joins the decode list, and unless it needs the full
        end rules for every token, its tokens take the fast path until its last."""
        if self._decoding_planned:
            self._unshare_decode_lists()
        decoding, tokens = self._decoding, self._decoding_tokens
        if not decoding:
            self._stops = seq.stop_token_ids
        assert seq.slot is not None
        index = bisect(self._decoding_slots, seq.slot)
        self._decoding_slots.insert(index, seq.slot)
        decoding.insert(index, seq)
        tokens.insert(index, seq.tokens)
        self._unplain += not seq.sampling.plain
        self._constrained += seq.constraint is not None
        seq.fast_until = 0 if seq.slow or seq.constraint is not None else seq.token_limit - 1
        self._off_fast_path += not seq.fast_until or seq.stop_token_ids != self._stops
        if seq.fast_until:  # its last token's update (its first is appended after this one)
            due = self._updates + seq.fast_until - len(seq.tokens)
            heappush(self._deadlines, (due, seq.admission, seq))

    def _decode_row(self, seq: Sequence) -> int:
        """The row of the decoding ``seq`` in the decode list, found by its slot."""
        decoding, slot = self._decoding, seq.slot
        row = len(decoding) if slot is None else bisect_left(self._decoding_slots, slot)
        if row == len(decoding) or decoding[row] is not seq:
            raise RuntimeError(f"request {seq.request_id!r} is not in the decode list")
        return row

    def _unshare_decode_lists(self) -> None:
        """A plan carries the decode list and its token lists: change copies of them from now
        on (called before a change, when ``_decoding_planned``)."""
        self._decoding = self._decoding.copy()
        self._decoding_tokens = self._decoding_tokens.copy()
        self._decoding_planned = False

    def _decodes_that_fit(self, now: float) -> list[Sequence]:
        """The decoding requests, with the blocks their tokens need set aside. When the cache
        cannot take one more token for each, preempt the most recently admitted running
        requests until it can (as vLLM does)."""
        decoding, books = self._decoding, self.books
        while True:
            free = books.total - books.used(self.slots.running())
            # a decode needs a new block when its cached tokens fill their blocks exactly
            needed = sum(1 for s in decoding if s.num_computed_tokens % books.block_size == 0)
            if needed <= free or not decoding:
                self._free_blocks = free - needed
                return decoding
            running = self.slots.running()
            policy = self.policy
            victim = max(running, key=_admission) if policy is None else policy.kv_victim(running)
            self.preempt(victim, now)
            decoding = self._decoding

    def _preempt_for_waiting(self, policy: Policy, now: float) -> None:
        """Every slot is busy and a request waits: preempt the running request the policy
        names for it, if any (one per step; the waiting request takes its slot in this step),
        once it has waited ``preemption_delay`` seconds."""
        if self.batching is BatchingPolicy.STATIC:
            return
        picked = policy.select(self.waiting, now)  # a waiting fork cannot start: the next can
        candidate = self._first_fitting(policy, None, now) if picked.awaits_fork else picked
        if candidate is None or now - candidate.queued_at < policy.config.preemption_delay:
            return  # it may still get a slot that frees on its own
        if self.config.max_loras is not None and not self._lora_fits(
            candidate, self._running_loras()
        ):
            return  # its adapter could not join the batch: a freed slot would go to another
        running = self.slots.running()
        if candidate.fork_of is not None:  # never its own source: it would wait for it again
            running = [seq for seq in running if seq is not candidate.fork_of]
        victim = policy.victim(candidate, running, now)
        # a victim one overtake from the bound would be served first again at once: a
        # preempt-and-readmit loop that would also leave the candidate waiting
        if victim is not None and victim.overtaken + 1 < policy.max_overtakes:
            policy.overtake(victim)
            self.preempt(victim, now)

    def _preempt_youngest_prefill(self, now: float) -> None:
        """Running requests are all prefilling and none has the blocks for its next chunk:
        give the most recently admitted one's blocks to the others."""
        victim = max(self._prefilling, key=lambda s: s.admission)
        self.preempt(victim, now)
        # nothing was handed out in this step yet: the free blocks are the books' own
        self._free_blocks = self.books.total - self.books.used(self.slots.running())

    def _chunk_prefills(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule the next chunk of every running request still prefilling, oldest admission
        first, within ``budget``; returns the budget left."""
        unstarted = self._unstarted
        for seq in self._prefilling:
            budget -= self._chunk(out, seq, budget, bool(unstarted) and seq.request_id in unstarted)
        return budget

    def _chunk(self, out: SchedulerOutput, seq: Sequence, budget: int, first: bool) -> int:
        """Schedule the next prefill chunk of ``seq`` within ``budget``; returns its length.
        The ``first`` chunk on its fresh slot (in the step that admits it, or later when static
        batching admitted it with no budget left) carries its cached prefix, if any."""
        start, books = seq.prefilled, self.books
        size = seq.prefill_target - start  # the rest, within the caps (``min`` costs more)
        if size > budget or size > self._chunk_cap:
            size = min(size, budget, self._chunk_cap)
        if self._count_blocks:  # (else the cache never binds)
            size = min(size, books.room(start, self._free_blocks))
            self._free_blocks -= books.blocks_for(start + size) - books.blocks_for(start)
        if size <= 0:
            return 0
        sample = start + size == seq.prefill_target
        assert seq.slot is not None
        if first and self._unstarted:
            self._unstarted.discard(seq.request_id)
        prefix = seq.tokens[:start] if first and start else ()
        source = None
        if first and seq.fork_of is not None:  # a fork: planned in the step that admits it,
            origin = seq.fork_of  # while its source decodes (a later copy could read a slot
            assert origin.status is RUNNING and not origin.prefilling  # reused)
            source = origin.slot
        seq.fork_of = None  # forked (or never to be): it is on its own from now on
        chunk = PrefillChunk(seq.slot, seq.tokens[start : start + size], start, sample,
                             seq.sampling, seq.request_id, prefix, seq, source)  # fmt: skip
        out.prefill_seqs.append(seq)
        out.prefills.append(chunk)
        out.num_prefill_tokens += size
        out.num_sampling_prefills += sample
        if not seq.sampling.plain:
            out.prefills_plain = False
        if seq.constraint is not None:
            out.prefills_constrained = True
        return size

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Move waiting requests into free slots while the budget and the cache allow."""
        static = self._static
        if static and self.slots.occupied:
            return budget
        # Static batching fills every slot at once (later steps prefill what the budget left).
        policy, waiting, slots = self.policy, self.waiting, self.slots
        loras = self._running_loras() if self.config.max_loras is not None else None
        general = loras is not None or self.prefix_cache is not None or self._count_blocks
        while (budget > 0 or static) and waiting.by_id and slots.free:
            seq = waiting.peek() if policy is None else policy.select(waiting, now)
            start = 0  # a request that fits whole, from position 0, needs nothing more
            if general or seq.fork_of is not None or seq.remote_tokens:
                found = self._admission_start(out, seq, policy, loras, now)
                if found is None:
                    break
                seq, start = found
            if policy is None:
                waiting.remove(seq.request_id)  # the head, or the first that may start
            else:
                self._take(policy, seq, now)
            slots.allocate(seq)
            set_status(seq, RUNNING)
            seq.prefilled, seq.prefill_target = start, len(seq.tokens)
            self._admissions += 1
            seq.admission = self._admissions
            if seq.times.admitted is None:  # its first admission (not a resume)
                seq.times.admitted = now
                out.admitted.append(seq)
            else:
                out.resumed.append(seq)
            self._prefilling.append(seq)
            size = self._chunk(out, seq, budget, True)
            if not size:  # (static batching with no budget left) its first chunk comes later
                self._unstarted.add(seq.request_id)
            budget -= size
        return budget

    def _admission_start(
        self, out: SchedulerOutput, seq: Sequence, policy: Policy | None,
        loras: set[str] | None, now: float,
    ) -> tuple[Sequence, int] | None:  # fmt: skip
        """The part of admitting ``seq`` beyond a slot: an adapter rule or a fork's wait (then
        the request admitted is the first that may start), a fork's or a producer's computed
        positions, the prefix cache's blocks, a KV cache that may be full. Returns the request
        and the position its prefill starts at, its blocks and adapter taken; None if no
        request may start or the cache has no room (it waits: first come, first served)."""
        if (loras is not None or seq.fork_of is not None) and not self._may_start(seq, loras):
            found = self._first_fitting(policy, loras, now)
            if found is None:
                return None  # every waiting request needs another adapter, or waits for its fork
            seq = found
        first = seq.times.admitted is None
        start = self._fork_start(seq) if seq.fork_of is not None else 0
        if seq.remote_tokens and first:  # its KV arrived: computed
            start = max(start, min(seq.remote_tokens, seq.prompt_len - 1))
        hits = self._cached_prefix(seq, start) if self.prefix_cache is not None else []
        # the cost in free blocks: cached blocks nobody uses, and a fork's own copies of
        # the prompt blocks the cache does not share
        cost = sum(1 for block in hits if block.refs == 0) if hits else 0
        if start:  # a fork's copies, or the blocks a producer sent
            cost += self.books.blocks_for(start) - len(hits)
        if self._count_blocks and not self.books.room(start, self._free_blocks - cost):
            return None
        if loras is not None and seq.lora is not None:
            self._load_lora(out, seq.lora, loras)
        self._free_blocks -= cost
        cached = len(hits) * self.books.block_size
        if self.prefix_cache is not None:
            self.prefix_cache.acquire(seq, hits)
            # a resume's re-lookup is not a query, nor is a request that skips the cache
            # (prompt log probabilities), as in vLLM
            if first and seq.prompt_logprobs is None:
                out.prefix_queries += seq.prompt_len
                out.prefix_hits += cached
        if seq.remote_tokens and first:  # (the cached blocks among them count as hits)
            out.remote_tokens += start - cached
        return seq, start or cached

    def _first_fitting(
        self, policy: Policy | None, loras: set[str] | None, now: float
    ) -> Sequence | None:
        """The request to admit among those that may start (``_may_start``): the earliest
        under fcfs, the policy's pick among them otherwise; None if none may."""
        fitting = (s for s in self.waiting if self._may_start(s, loras))
        if policy is None:
            return next(fitting, None)
        candidates = list(fitting)
        return policy.select(candidates, now) if candidates else None

    def _may_start(self, seq: Sequence, loras: set[str] | None) -> bool:
        """Whether the waiting ``seq`` may take a free slot now: its adapter may join the batch
        (``loras``: the running adapters, None when there is no adapter rule) and it does not
        wait for the request it forks from to finish its prefill."""
        return (loras is None or self._lora_fits(seq, loras)) and not seq.awaits_fork

    def _fork_start(self, seq: Sequence) -> int:
        """Where the waiting ``seq`` starts: a fork whose source decodes starts at its last
        prompt position (the ones before are copied from the source's slot); anything else
        at 0 (a fork whose source has ended prefills alone)."""
        source = seq.fork_of
        if source is None:
            return 0
        if source.status is RUNNING and not source.prefilling:
            return seq.prompt_len - 1
        seq.fork_of = None
        return 0

    def _running_loras(self) -> set[str]:
        """The adapters of the running requests."""
        return {seq.lora for seq in self.slots.running() if seq.lora is not None}

    def _lora_fits(self, seq: Sequence, loras: set[str]) -> bool:
        """Whether ``seq`` may join a batch running adapters ``loras``."""
        assert self.config.max_loras is not None
        return seq.lora is None or seq.lora in loras or len(loras) < self.config.max_loras

    def _load_lora(self, out: SchedulerOutput, lora: str, loras: set[str]) -> None:
        """``lora`` joins the batch; if it is not in an adapter slot, it is loaded there (in
        place of the least recently admitted adapter no running request uses)."""
        assert self.config.max_loras is not None
        loras.add(lora)
        slots = self._lora_slots
        if lora in slots:
            del slots[lora]  # most recently admitted: last
        else:
            out.lora_loads += 1
            if len(slots) >= self.config.max_loras:
                idle = next(name for name in slots if name not in loras)
                del slots[idle]
        slots[lora] = None

    def _take(self, policy: Policy, seq: Sequence, now: float) -> None:
        """Take ``seq`` out of the queue for admission: every request ahead of it in the queue
        is overtaken once (but a fork waiting for its source, which could not start); its own
        count restarts."""
        for ahead in self.waiting:
            if ahead is seq:
                break
            if not ahead.awaits_fork:
                policy.overtake(ahead)
        self.waiting.remove(seq.request_id)
        seq.overtaken = 0  # served: the count restarts
        policy.on_admitted(seq, now, first=seq.times.admitted is None)

    def _cached_prefix(self, seq: Sequence, start: int = 0) -> list[CachedBlock]:
        """The cached leading blocks of ``seq``'s prompt (none without a prefix cache). At
        least its last token is always computed, to sample from. A fork (``start``: its copied
        positions) references the cached blocks among them, which its source has published."""
        if self.prefix_cache is None or seq.prompt_logprobs is not None:
            return []  # prompt log probabilities need every prompt position computed
        return self.prefix_cache.lookup(seq, start or len(seq.tokens) - 1)

    def _apply_decodes(
        self,
        out: SchedulerOutput,
        tokens: list[int],
        outcome: StepOutcome,
        logprobs: list[Logprobs | None] | None,
    ) -> int:
        """The hot path: one token for each decoding request. Returns the tokens applied."""
        seqs = out.decode_seqs
        # no request joined or left since the plan, none needs the end rules for every token
        # and all share one stop set: only the requests at their last token or given a stop
        # token need them
        if seqs is self._decoding and not self._off_fast_path:
            # every token appended at C speed (``map`` stops at the last decode: ``tokens``
            # goes on with the prefills'), then the rows that need the end rules taken back
            _consume(map(_APPEND, out.decode_inputs, tokens))
            deadlines, stopped = self._deadlines, not self._stops.isdisjoint(tokens)
            due = self._pop_due() if deadlines and deadlines[0][0] <= self._updates else []
            dropped = self._end_rows(out, tokens, outcome, due, stopped) if due or stopped else 0
            outcome.num_generated += len(seqs) - dropped
            return len(seqs)
        finished, now = outcome.finished, outcome.ended_at
        skipped = dropped = 0
        # a token needs the end rules if it is a stop token or the request's last, or if the
        # request needs them for every token or has left its slot (``fast_until``: 0); the log
        # probabilities are looked up only for those tokens. Each request's token list comes
        # from ``decode_inputs`` (the same list as ``seq.tokens``), walked beside it
        logprob = None if logprobs is None else dict(zip(seqs, logprobs, strict=False)).get
        for seq, prefix, token in zip(seqs, out.decode_inputs, tokens, strict=False):
            if token in seq.stop_token_ids or len(prefix) >= seq.fast_until:
                if seq.status is not RUNNING:
                    skipped += 1  # aborted or preempted while the model ran: token dropped
                else:
                    dropped += self._append(seq, token, now, finished, logprob and logprob(seq))
            else:
                prefix.append(token)  # one token, not the last: the request has computed it
        self._pop_due()  # (every request due went through the end rules above: none is left)
        outcome.num_generated += len(seqs) - skipped - dropped
        return len(seqs) - skipped

    def _pop_due(self) -> list[Sequence]:
        """Take the deadlines due in this update off the heap and return the requests still
        decoding at them (at their last token, ``fast_until`` tokens before it); stale
        deadlines (requests that ended early) go too."""
        deadlines, update, due = self._deadlines, self._updates, []
        while deadlines and deadlines[0][0] <= update:
            _, admission, seq = heappop(deadlines)
            if seq.fast_until and seq.admission == admission:
                due.append(seq)
        return due

    def _end_rows(
        self,
        out: SchedulerOutput,
        tokens: list[int],
        outcome: StepOutcome,
        due: list[Sequence],
        stopped: bool,
    ) -> int:
        """After a C-speed append, take back the tokens of the decode rows that need the end
        rules, those given a stop token (if ``stopped``: some token of the step is one) and
        those of the ``due`` requests (at their last token; no request has left the plan's list
        yet), and put them through the rules, in row order. Returns the tokens left out of the
        output."""
        seqs, now, finished = out.decode_seqs, outcome.ended_at, outcome.finished
        rows = _stop_rows(self._stops, tokens[: len(seqs)]) if stopped else []
        for seq in due:
            rows.append(self._decode_row(seq))
        if len(rows) > 1:  # in row order, once (a request given a stop token may also be due)
            rows = sorted(set(rows))
        dropped = 0
        for row in rows:
            out.decode_inputs[row].pop()
            dropped += self._append(seqs[row], tokens[row], now, finished)
        return dropped

    def _apply_prefills(
        self, out: SchedulerOutput, result: ModelOutput, outcome: StepOutcome
    ) -> None:
        tokens, index, now = result.tokens, len(out.decode_seqs), outcome.ended_at
        for seq, chunk in zip(out.prefill_seqs, out.prefills, strict=True):
            if result.unavailable_slots and not result.ran(chunk):  # its slot could not be
                if seq.status is RUNNING:  # reset: back to the queue (no preemption)
                    was = PREEMPTED if seq.num_preemptions else WAITING
                    self._requeue(seq, was, now)
                continue
            token = tokens[index] if chunk.sample else NO_TOKEN
            index += chunk.sample
            if seq.status is not RUNNING:
                continue  # aborted or preempted while the model ran
            seq.prefilled = chunk.start + len(chunk.token_ids)
            if self.prefix_cache is not None:
                self.prefix_cache.publish(seq)
            if result.prompt_logprobs is not None and not seq.prompt_logprobs_done:
                _store_prompt_logprobs(seq, result.prompt_logprobs.get(seq.request_id))
            if not chunk.sample:  # a partial chunk: its prefill goes on
                continue
            self._prefilling.remove(seq)
            self._start_decoding(seq)  # it decodes from the next step on
            if seq.times.first_token is None:
                seq.times.first_token = now
            if (  # no end rule applies: the test of ``_apply_decodes``, and no missing token
                token != NO_TOKEN
                and token not in seq.stop_token_ids
                and len(seq.tokens) < seq.fast_until
            ):
                seq.tokens.append(token)
                outcome.num_generated += 1
                continue
            logprob = None if result.logprobs is None else result.logprobs[index - 1]
            outcome.num_generated += 1 - self._append(seq, token, now, outcome.finished, logprob)

    def _append(
        self,
        seq: Sequence,
        token: int,
        now: float,
        finished: list[Sequence],
        logprob: Logprobs | None = None,
    ) -> int:
        """Append ``token`` (and its log probabilities, if asked for) and apply the end rules:
        a stop token (kept only with ``include_stop``), a stop string, ``max_tokens``, the end
        of its grammar. Before ``min_tokens`` tokens were generated, a stop token is an ordinary
        token (the model should not have sampled it) and stop strings do not match
        (``StopStrings`` counts). A request with ``max_tokens == 0`` (it ran only for its prompt
        log probabilities) keeps nothing. Returns 1 if the token was left out of the output (a
        stop token, or a token its grammar refused), else 0."""
        if seq.max_tokens == 0:
            self._finish(seq, REASON_LENGTH, now)
            finished.append(seq)
            return 1
        if token == NO_TOKEN and seq.constraint is not None and seq.constraint.stopped:
            self._finish(seq, FinishReason.STOP, now)  # only EOS could follow, and the request's
            finished.append(seq)  # bans (min_tokens ...) forbid it: its text is complete
            return 1
        if token == NO_TOKEN:
            seq.error = NoTokenLeftError(  # the client's bans, not a model fault
                "no token is left to sample: the request's bans (logit_bias, bad_words, "
                "min_tokens) and allowed_token_ids forbid every token"
                + (" its grammar allows" if seq.constraint is not None else "")
            )
            self._finish(seq, FinishReason.ERROR, now)
            finished.append(seq)
            return 1
        if seq.constraint is not None and not seq.constraint.accept(token):
            seq.error = seq.constraint.refusal(token)  # a grammar-engine limit, or a model bug
            self._finish(seq, FinishReason.ERROR, now)
            finished.append(seq)
            return 1
        if token in seq.stop_token_ids and seq.num_generated >= seq.sampling.min_tokens:
            reason = REASON_STOP
            seq.stop_token = token
            if not seq.include_stop:
                self._finish(seq, reason, now)
                finished.append(seq)
                return 1
            seq.tokens.append(token)
            if seq.logprobs is not None:
                seq.logprobs.append(logprob)
        else:
            seq.tokens.append(token)
            if seq.logprobs is not None:
                seq.logprobs.append(logprob)
            if seq.stop is not None and seq.stop.feed([token]):
                reason = REASON_STOP
            elif len(seq.tokens) >= seq.token_limit:
                reason = REASON_LENGTH
            elif seq.constraint is not None and seq.constraint.finished:
                reason = REASON_STOP  # its grammar ended on a token that is no stop token
            else:
                return 0
        self._finish(seq, reason, now)
        finished.append(seq)
        return 0

    # --- ends -------------------------------------------------------------------------------

    def _end_all(
        self, seqs: list[Sequence], now: float, error: BaseException | None
    ) -> list[Sequence]:
        for seq in seqs:
            seq.error = error
            self._finish(seq, FinishReason.ABORT if error is None else FinishReason.ERROR, now)
        return seqs

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        if self.policy is not None:
            self.policy.on_finished(seq)
        if seq.status is RUNNING:
            if seq.remote_decode and reason is FinishReason.LENGTH:  # its KV waits for a pull
                blocks = self.books.blocks_for(seq.prompt_len)
                seq.held = self.holds.hold(seq.request_id, blocks, seq.prompt_len, now).block_ids
            self._leave_slot(seq)
        set_status(seq, FINISHED, reason, now)

    def _requeue(self, seq: Sequence, status: RequestStatus, now: float) -> None:
        """Back to the queue (its front, unless the policy says its back), to be recomputed
        from position 0."""
        self._leave_slot(seq)
        set_status(seq, status)
        policy = self.policy
        if policy is None or policy.requeue_front:
            self.waiting.push_front(seq)
        else:
            self.waiting.push(seq)
        if policy is not None:
            policy.on_queued(seq, now, new=False)

    def _leave_slot(self, seq: Sequence) -> None:
        """The running ``seq`` gives up its slot and its blocks."""
        if seq.prefilled < seq.prefill_target:  # prefilling
            self._prefilling.remove(seq)
            self._unstarted.discard(seq.request_id)
        else:  # it leaves the decode list
            if self._decoding_planned:
                self._unshare_decode_lists()
            decoding, tokens = self._decoding, self._decoding_tokens
            index = self._decode_row(seq)
            del decoding[index], tokens[index], self._decoding_slots[index]
            self._unplain -= not seq.sampling.plain
            self._constrained -= seq.constraint is not None
            self._off_fast_path -= not seq.fast_until or seq.stop_token_ids != self._stops
            seq.fast_until = 0
            # its deadline, if not yet due, is stale now; stale ones go when they outnumber
            # the decodes
            deadlines = self._deadlines
            if len(deadlines) > 2 * len(decoding) + 32:
                deadlines[:] = [d for d in deadlines if d[2].fast_until and d[2].admission == d[1]]
                heapify(deadlines)
        self._released.append(self.slots.release(seq))
        seq.prefilled = 0
        if self.prefix_cache is not None:
            self.prefix_cache.release(seq)


def set_status(
    seq: Sequence, status: RequestStatus, reason: FinishReason | None = None, now: float = 0.0
) -> None:
    """The one writer of a request's status (tests/test_layering.py keeps it so): the
    ``Scheduler`` makes every change through it. A finished request also gets ``reason`` and
    its end time ``now``, and its grammar state is freed. Outside a scheduler, only a request
    no scheduler holds is ended here (an injected failure, the engine's last resort)."""
    seq.status = status
    if status is FINISHED:
        seq.finish_reason = reason
        seq.constraint = None
        seq.times.finished = now


def _forks_a_running_request(seq: Sequence) -> bool:
    source = seq.fork_of
    return source is not None and source.status is RUNNING


def _store_prompt_logprobs(seq: Sequence, found: tuple[int, list[Logprobs]] | None) -> None:
    """Keep the prompt log probabilities a step computed for ``seq``, in position order: only
    those that continue what it has (a resumed request's recomputed prompt adds nothing)."""
    stored = seq.prompt_logprobs
    if found is None or stored is None:
        return
    position, entries = found
    skip = len(stored) - position
    if skip >= 0:
        stored.extend(entries[skip : max(skip, seq.prompt_len - position)])


def _stop_rows(stops: frozenset[int], tokens: list[int]) -> list[int]:
    """The rows of ``tokens`` that hold a stop token, found at C speed: one pass for the stop
    tokens present, then one ``list.index`` per hit."""
    rows = []
    for stop in stops.intersection(tokens):
        row = -1
        for _ in range(countOf(tokens, stop)):
            row = tokens.index(stop, row + 1)
            rows.append(row)
    return rows
