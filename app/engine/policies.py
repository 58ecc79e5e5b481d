"""Scheduling policies: which waiting request gets the next free slot, which running request (if
any) gives its slot up to a waiting one, and where a preempted request goes back in the queue.

The ``Scheduler`` calls a policy at four points: ``select`` (admission), ``victim`` (at the start
of a step, when a request waits and every slot is busy; at most one preemption per step),
``on_queued``/``on_admitted``/``on_preempted``/``on_finished`` (bookkeeping), and ``charge`` (once
per planned step, only for a policy with ``charges = True``). ``fcfs`` has no policy object: the
scheduler keeps its FIFO fast path, so its behaviour and speed are exactly those without policies.

Bounded bypass, for every policy: a waiting request is *overtaken* when a request standing behind
it in the queue is admitted before it (and a policy preemption counts as one). A request
overtaken ``max_overtakes`` times is admitted at the next free slot before anything the policy
prefers (first in queue order among such requests); the count restarts at each admission. A
policy never preempts a request that has not produced a token since its admission (still
prefilling), so every admission yields at least one token: a request waits at most
``max_overtakes`` overtakes per admission and needs at most ``max_tokens`` admissions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from operator import attrgetter

from app.engine.step import SchedulerOutput
from app.engine.types import RequestStatus, Sequence

SortKey = Callable[[Sequence], float]


class PolicyName(StrEnum):
    FCFS = "fcfs"  # first come, first served (no policy object; today's behaviour)
    PRIORITY = "priority"  # the request's priority, lower first; preemptive
    MLFQ = "mlfq"  # FastServe's skip-join multi-level feedback queue; preemptive time slicing
    FAIR = "fair"  # per-user fairness: the Virtual Token Counter (VTC); not preemptive


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """A policy and its knobs (the ``--policy`` flags)."""

    name: PolicyName = PolicyName.FCFS
    max_overtakes: int = 256
    preemption_threshold: int = 1
    preemption_delay: float = 0.0  # seconds a request waits before it may cause a preemption
    mlfq_levels: int = 4
    mlfq_quantum: int = 16
    mlfq_aging_seconds: float = 2.0
    mlfq_skip_join_tokens: int = 512
    fair_prompt_weight: float = 1.0
    fair_output_weight: float = 2.0
    fair_preemption: bool = True
    fair_preemption_margin: float = 32.0  # counter units a victim's user must lead by

    def __post_init__(self) -> None:
        if self.preemption_delay < 0:
            raise ValueError(f"preemption_delay must be >= 0, got {self.preemption_delay}")
        for name in ("max_overtakes", "preemption_threshold", "mlfq_levels", "mlfq_quantum",
                     "mlfq_skip_join_tokens"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


FCFS = PolicyConfig()  # the default: no policy object


class Policy:
    """The interface and the bounded bypass every policy shares. A subclass gives ``sort_key``
    (lower is admitted first; ties go to the earlier request in queue order) and may give
    ``victim``."""

    requeue_front = True  # a preempted request goes back to the front of the queue
    charges = False  # whether ``charge`` must be called every step

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.max_overtakes = config.max_overtakes
        self.starving = 0  # requests that reached the bound (an upper bound: some may be gone)

    def sort_key(self, now: float) -> SortKey:
        """The admission order at ``now``: a function of a waiting request, lower first."""
        raise NotImplementedError

    def select(self, queue: Iterable[Sequence], now: float) -> Sequence:
        """The waiting request to admit next (``queue`` is non-empty, in queue order): the
        first one at the bypass bound, else the policy's first (``min`` keeps the earlier of
        equals). One C-level pass over the queue unless a request may be at the bound."""
        if self.starving:
            limit = self.max_overtakes
            for seq in queue:
                if seq.overtaken >= limit:
                    return seq  # bounded bypass: served next
            self.starving = 0  # they have all left the queue
        return min(queue, key=self.sort_key(now))

    def overtake(self, seq: Sequence) -> None:
        """``seq`` was passed over (or preempted) once more."""
        seq.overtaken += 1
        if seq.overtaken == self.max_overtakes:
            self.starving += 1

    def preemptible(self, seq: Sequence) -> bool:
        """Whether a policy may take ``seq``'s slot: not before it produced a token since its
        admission (a preempted prefill would be wasted, and progress would not be bounded)."""
        return not seq.prefilling

    def victim(self, waiting: Sequence, running: list[Sequence], now: float) -> Sequence | None:
        """The running request to preempt so ``waiting`` (``select``'s choice) gets its slot."""
        return None

    def kv_victim(self, running: list[Sequence]) -> Sequence:
        """The running request to preempt when the KV cache cannot hold every decode: the
        most recently admitted (as vLLM's fcfs does)."""
        return max(running, key=_ADMISSION)

    def on_queued(self, seq: Sequence, now: float, new: bool) -> None:
        """``seq`` entered the queue: as a new arrival, or back from a slot."""
        seq.queued_at = now

    def on_admitted(self, seq: Sequence, now: float, first: bool) -> None:
        """``seq`` got a slot (``first``: its first admission, not a resume)."""

    def on_preempted(self, seq: Sequence, now: float) -> None:
        """``seq`` is about to give its slot up (still running)."""

    def on_finished(self, seq: Sequence) -> None:
        """``seq`` ended (its status is still the one it had)."""

    def charge(self, out: SchedulerOutput) -> None:
        """The step ``out`` was planned (only called when ``charges``)."""

    def level(self, seq: Sequence) -> int | None:
        """The request's queue level now, for ``/slots`` (None: the policy has none)."""
        return None


class PriorityPolicy(Policy):
    """Lower ``priority`` first, FIFO within a priority. When a request waits and every slot is
    busy, the running request with the worst priority (the most recently admitted among equals)
    is preempted if it is worse than the waiting one by at least ``preemption_threshold``."""

    def sort_key(self, now: float) -> SortKey:
        return _PRIORITY

    def victim(self, waiting: Sequence, running: list[Sequence], now: float) -> Sequence | None:
        worst: Sequence | None = None
        for seq in running:
            if self.preemptible(seq) and (
                worst is None or (seq.priority, seq.admission) > (worst.priority, worst.admission)
            ):
                worst = seq
        threshold = self.config.preemption_threshold
        if worst is not None and worst.priority - waiting.priority >= threshold:
            return worst
        return None

    def kv_victim(self, running: list[Sequence]) -> Sequence:
        """The worst priority gives its blocks up first (the most recent among equals), as
        vLLM's priority scheduler does."""
        return max(running, key=lambda seq: (seq.priority, seq.admission))


class MLFQPolicy(Policy):
    """FastServe's skip-join multi-level feedback queue, in decode steps.

    Level 0 is served first. A new request joins the level its prompt length puts it in
    (skip-join): level 0 up to ``mlfq_skip_join_tokens`` prompt tokens, one level lower per
    doubling. Level ``l``'s quantum is ``mlfq_quantum * 2**l`` decode steps; a running request that
    has used it drops one level (computed lazily from its tokens, so the hot path pays nothing).
    A waiting request rises one level per ``mlfq_aging_seconds`` waited. When a request waits and
    every slot is busy, the running request at the lowest level strictly below the waiting one's
    is preempted, and goes to the back of the queue; at the bottom level, one that has used a
    bottom quantum is preempted for a waiting bottom-level request (round robin).
    """

    requeue_front = False

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.bottom = config.mlfq_levels - 1

    def quantum(self, level: int) -> int:
        return self.config.mlfq_quantum << level

    def join_level(self, prompt_len: int) -> int:
        level, limit = 0, self.config.mlfq_skip_join_tokens
        while prompt_len > limit and level < self.bottom:
            level, limit = level + 1, limit * 2
        return level

    def waiting_level(self, seq: Sequence, now: float) -> int:
        aging = self.config.mlfq_aging_seconds
        lift = int((now - seq.queued_at) / aging) if aging > 0 else 0
        return max(0, seq.level - lift)

    def running_level(self, seq: Sequence) -> tuple[int, bool]:
        """(level now, whether it has used a whole quantum at the bottom level)."""
        used, level = seq.num_generated - seq.slice_start, seq.level
        while used >= self.quantum(level):
            if level == self.bottom:
                return level, True
            used -= self.quantum(level)
            level += 1
        return level, False

    def sort_key(self, now: float) -> SortKey:
        aging = self.config.mlfq_aging_seconds
        if aging <= 0:
            return _LEVEL
        recent = now - aging  # queued after this: not lifted yet (the common case)
        return lambda seq: (
            seq.level
            if seq.queued_at > recent
            else max(0, seq.level - int((now - seq.queued_at) / aging))
        )

    def victim(self, waiting: Sequence, running: list[Sequence], now: float) -> Sequence | None:
        target = self.waiting_level(waiting, now)
        worst: Sequence | None = None
        worst_key: tuple[int, bool, int] = (-1, False, 0)
        for seq in running:
            if not self.preemptible(seq):
                continue
            level, expired = self.running_level(seq)
            if level > target or (expired and level == target):
                key = (level, expired, seq.admission)
                if key > worst_key:
                    worst, worst_key = seq, key
        return worst

    def on_queued(self, seq: Sequence, now: float, new: bool) -> None:
        seq.queued_at = now
        if new:
            seq.level = self.join_level(seq.prompt_len)

    def on_admitted(self, seq: Sequence, now: float, first: bool) -> None:
        seq.level = self.waiting_level(seq, now)
        seq.slice_start = seq.num_generated

    def on_preempted(self, seq: Sequence, now: float) -> None:
        seq.level = self.running_level(seq)[0]

    def level(self, seq: Sequence) -> int | None:
        return self.running_level(seq)[0] if seq.status is RequestStatus.RUNNING else seq.level


class FairPolicy(Policy):
    """Per-user fairness, the Virtual Token Counter (Sheng et al., OSDI'24), with preemption.

    Each user's counter grows by ``fair_prompt_weight`` per prompt token when one of its requests
    is first admitted and ``fair_output_weight`` per token generated for it. Admission takes the
    oldest waiting request of the backlogged user (one with a waiting request) whose counter is
    smallest. A user who becomes backlogged has its counter lifted to the smallest counter of the
    backlogged users (or, if none, to the last admitted user's), so idling earns no credit. Work
    conserving: a free slot always takes a waiting request. Beyond the paper (whose VTC only
    orders admissions), when every slot is busy the most recently admitted request of the
    running user with the largest counter is preempted for a waiting request whose user's
    counter is smaller by more than ``fair_preemption_margin`` (``fair_preemption``), so a light
    user does not wait for a slot to free, and two users' counters cannot leapfrog each other
    with a preemption every token.
    The user is ``Sequence.user`` (None counts as one anonymous user).
    """

    charges = True

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.counters: dict[str | None, float] = {}
        self.backlog: Counter[str | None] = Counter()  # waiting requests per user
        self._last = 0.0

    def sort_key(self, now: float) -> SortKey:
        counters = self.counters
        return lambda seq: counters[seq.user]

    def victim(self, waiting: Sequence, running: list[Sequence], now: float) -> Sequence | None:
        if not self.config.fair_preemption:
            return None
        counters, worst = self.counters, None
        # The victim's user must lead by a margin: without it two users' counters leapfrog
        # every token or two, and every leap recomputes a whole context.
        lead = counters[waiting.user] + self.config.fair_preemption_margin
        worst_key: tuple[float, int] = (lead, 1 << 62)
        for seq in running:
            key = (counters.get(seq.user, 0.0), seq.admission)
            if seq.user != waiting.user and key > worst_key and self.preemptible(seq):
                worst, worst_key = seq, key
        return worst

    def on_queued(self, seq: Sequence, now: float, new: bool) -> None:
        seq.queued_at = now
        user = seq.user
        if not self.backlog[user]:
            backlogged = [self.counters[u] for u, n in self.backlog.items() if n]
            floor = min(backlogged) if backlogged else self._last
            self.counters[user] = max(self.counters.get(user, 0.0), floor)
        self.backlog[user] += 1

    def on_admitted(self, seq: Sequence, now: float, first: bool) -> None:
        user = seq.user
        self._unqueue(user)
        if first:
            self.counters[user] += self.config.fair_prompt_weight * seq.prompt_len
        self._last = self.counters[user]

    def on_finished(self, seq: Sequence) -> None:
        if seq.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self._unqueue(seq.user)

    def _unqueue(self, user: str | None) -> None:
        self.backlog[user] -= 1
        if not self.backlog[user]:
            del self.backlog[user]

    def charge(self, out: SchedulerOutput) -> None:
        weight, counters = self.config.fair_output_weight, self.counters
        for seq in out.decode_seqs:
            counters[seq.user] += weight
        for seq, chunk in zip(out.prefill_seqs, out.prefills, strict=True):
            if chunk.sample:
                counters[seq.user] += weight


_PRIORITY: SortKey = attrgetter("priority")
_ADMISSION: SortKey = attrgetter("admission")
_LEVEL: SortKey = attrgetter("level")


def make_policy(config: PolicyConfig) -> Policy | None:
    """The policy object for ``config`` (None for fcfs: the scheduler's FIFO fast path)."""
    classes: dict[PolicyName, type[Policy]] = {
        PolicyName.PRIORITY: PriorityPolicy,
        PolicyName.MLFQ: MLFQPolicy,
        PolicyName.FAIR: FairPolicy,
    }
    cls = classes.get(config.name)
    return None if cls is None else cls(config)
