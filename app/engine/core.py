"""The engine's state, as plain synchronous methods: the requests it knows, their streams and the
scheduler. The asyncio loop in ``engine.py`` is a thin driver around it, so the stateful tests
drive this class step by step without an event loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from app.engine.errors import DuplicateRequestError, QueueFullError
from app.engine.prefix_cache import CacheEvent
from app.engine.runner import ModelRunner, close_quietly
from app.engine.scheduler import Scheduler, SchedulerConfig, set_status
from app.engine.snapshot import WAITING_SHOWN, EngineSnapshot, SlotView
from app.engine.step import ModelOutput, SchedulerOutput, StepOutcome
from app.engine.step_clock import NO_STEP_TIME, StepTimeModel
from app.engine.stream import RequestStream
from app.engine.types import FinishReason, RequestStatus, Sequence

log = logging.getLogger("slotserve.engine")


@dataclass(frozen=True, slots=True)
class EngineConfig(SchedulerConfig):
    """The engine's limits: the scheduler's (a ``SchedulerConfig``, handed to the scheduler
    whole: a new scheduler setting is a field there) and the engine's own below."""

    num_slots: int = 8
    # n > 1: choices after the first fork from its prompt cache (``Engine`` turns it off for a
    # model that cannot share prompts)
    share_prompts: bool = True
    max_waiting: int = 1024  # requests that may wait beyond the free slots before submit() refuses
    step_costs: StepTimeModel = NO_STEP_TIME  # the simulated step time (zero: none)
    step_jitter: float = 0.0  # the step clock's jitter (std-dev / mean)
    # A request may be scheduled ``admission_delay`` seconds after it arrived (the API time of
    # the server imitated), and with ``late_admission`` one step later than the next if it
    # arrived while a step ran (vLLM v1's engine core plans a step ahead; docs/fidelity.md).
    admission_delay: float = 0.0
    late_admission: bool = False
    seed: int = 0  # the step clock's jitter
    # Run each model call in a worker thread, unless the model declares ``blocking = False``
    # (its calls are quick and never wait: a thread hop would cost more than the call).
    offload_model_calls: bool = True


def _slot_view(seq: Sequence | None) -> SlotView | None:
    if seq is None:
        return None
    return SlotView(
        seq.request_id, seq.prefilling, seq.num_generated, seq.max_tokens, seq.num_preemptions
    )


class EngineObserver(Protocol):
    """Receives the engine's events (metrics, logs). Called on the engine task; must be quick."""

    def on_step(self, outcome: StepOutcome) -> None:
        """Once per model call, after its tokens or its failure were applied."""
        ...

    def on_finished(self, seq: Sequence) -> None:
        """Exactly once per request, however it ended (stop, length, abort, error), including
        requests that never reached a slot."""
        ...


class KVEventSink(Protocol):
    """Receives the prefix cache's changes once per step that had any (KV events). Called on
    the engine task; must not block (app/kv_events/publisher.py queues them)."""

    def publish(self, events: list[CacheEvent]) -> None: ...


class EngineCore:
    """Live requests by id, their streams, and the scheduler. ``live`` holds every request that
    has not finished: waiting (in the inbox or the queue) or running."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_events: KVEventSink | None = None,
    ) -> None:
        self.config = config
        self.kv_events = kv_events if config.record_kv_events else None
        self.runner = runner
        self.scheduler = Scheduler(config)
        self.live: dict[str, RequestStream] = {}
        # Live requests with an abort on its way through the inbox: they no longer count
        # against the queue bound, so a client that cancels can submit again at once.
        self.aborting: set[str] = set()
        self.observer = observer
        self.clock = clock
        # Exceptions raised by the observer, by method and type: contained, logged once per
        # kind, counted (a metrics bug must not take the engine down).
        self.observer_errors: Counter[str] = Counter()

    def has_work(self) -> bool:  # a request waits in the scheduler's queue or runs
        return self.scheduler.has_work()

    def is_live(self, request_id: str) -> bool:  # registered and not finished
        return request_id in self.live

    def note_abort(self, request_id: str) -> bool:
        """An abort of the live ``request_id`` is on its way (it no longer counts against the
        queue bound); False if one already was."""
        first = request_id not in self.aborting
        self.aborting.add(request_id)
        return first

    # the model's calls: where they run (the engine's worker thread, if any); none of them
    # touches the scheduler
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        return self.runner.execute(out)

    def constrained(self, out: SchedulerOutput) -> bool:
        return self.runner.constrained(out)

    def retry_resets(self) -> frozenset[int]:
        return self.runner.retry_resets()

    def release_slots(self) -> None:
        """Idle (no step runs or is planned): the model drops every cache it holds, the
        scheduler's pending releases included (failures logged: ``close_quietly``)."""
        self.scheduler.take_released()
        close_quietly(self.runner)

    def set_out_of_service(self, slots: frozenset[int]) -> None:
        """The slots the model could not reset are out of service (every other one is back)."""
        self.scheduler.slots.set_out_of_service(slots)

    def end_everything(
        self, unqueued: list[Sequence], reason: FinishReason, error: BaseException | None
    ) -> None:
        """The engine's loop is gone: end every request, ``unqueued`` ones (registered, never
        handed to the scheduler) included, with ``abort`` or ``error``; any live request the
        scheduler lost track of ends with ``reason``."""
        for seq in unqueued:
            self.scheduler.waiting.push(seq)
        self.end_all(error)
        for stream in list(self.live.values()):
            stream.seq.error = error
            set_status(stream.seq, RequestStatus.FINISHED, reason, self.clock())
            stream.notify()
        self.live.clear()
        self.aborting.clear()

    @property
    def num_running(self) -> int:
        return self.scheduler.slots.occupied

    @property
    def num_waiting(self) -> int:
        """Live requests without a slot: queued, or submitted and not yet taken from the inbox
        (so an abort not yet applied still counts)."""
        return len(self.live) - self.scheduler.slots.occupied

    def snapshot(self) -> EngineSnapshot:
        """The slot table, the head of the queue and the KV usage now (app/engine/snapshot.py)."""
        scheduler = self.scheduler
        table = scheduler.slots
        slots = tuple(_slot_view(table.get(index)) for index in range(table.capacity))
        waiting = tuple(seq.request_id for seq in islice(scheduler.waiting, WAITING_SHOWN))
        return EngineSnapshot(
            slots, table.out_of_service, waiting, self.num_waiting, self.kv_cache_usage()
        )

    def kv_cache_usage(self) -> float:
        """The share of the KV cache's blocks in use now."""
        return self.scheduler.books.usage(self.scheduler.slots.running())

    def has_room(self) -> bool:
        """Whether ``register`` would take one more request (slots + ``max_waiting``). A
        request being aborted frees its place at once, but no more than another whole bound
        of them are kept (a submit-and-cancel loop during one long model call)."""
        bound = self.config.num_slots + self.config.max_waiting
        return len(self.live) - len(self.aborting) < bound and len(self.live) < 2 * bound

    def register(self, seq: Sequence) -> RequestStream:
        """Accept a new request (before it reaches the scheduler) or refuse it."""
        if seq.request_id in self.live:
            raise DuplicateRequestError(f"request id {seq.request_id!r} is already in use")
        if not self.has_room():
            raise QueueFullError.for_bounds(self.config.num_slots, self.config.max_waiting)
        stream = RequestStream(seq)
        self.live[seq.request_id] = stream
        return stream

    def add(self, seq: Sequence) -> None:
        """Hand a registered request to the scheduler."""
        if self.scheduler.add(seq, self.clock()):
            self._finished(seq)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End one waiting or running request with ``reason``; unknown ids are ignored."""
        seq = self.scheduler.abort(request_id, self.clock(), reason)
        if seq is not None:
            self._finished(seq)

    def abort_waiting(self) -> None:
        """End every request still waiting for a slot with ``abort`` (drain)."""
        for seq in self.scheduler.abort_waiting(self.clock()):
            self._finished(seq)

    def end_all(self, error: BaseException | None = None) -> None:
        """End every waiting and running request with ``abort`` (end of the grace period), or
        with ``error`` (the engine is dying)."""
        now = self.clock()
        ended = (
            self.scheduler.abort_all(now) if error is None else self.scheduler.fail_all(error, now)
        )
        for seq in ended:
            self._finished(seq)

    def fail_waiting(self, error: BaseException) -> None:
        """End every request waiting for a slot with ``error`` (no slot can serve them)."""
        for seq in self.scheduler.fail_waiting(error, self.clock()):
            self._finished(seq)

    def schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule(self.clock())
        if out.empty:  # no step will follow at once: publish this one's evictions now
            self._publish_kv_events()
        return out

    def release_kv_hold(self, request_id: str) -> int | None:
        """A remote decoder pulled the blocks ``request_id`` (a finished ``remote_decode``
        prefill) holds: they are free now. Returns the tokens they held; None if none are held
        for it (never, pulled already, or expired)."""
        held = self.scheduler.release_held(request_id, self.clock())
        return None if held is None else held.num_tokens

    def next_hold_expiry(self) -> float | None:
        """When the oldest blocks held for a remote decoder expire (on ``clock``); None: none
        are held."""
        return self.scheduler.holds.next_expiry

    def expire_holds(self) -> None:
        """Let go the held blocks past their time (``schedule`` does it too, at every step)."""
        self.scheduler.holds.expire(self.clock())

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block no running request uses (vLLM's ``reset_prefix_cache``);
        True if the cache is now empty (published as ``AllBlocksCleared``)."""
        cache = self.scheduler.prefix_cache
        cleared = cache is None or cache.clear_free()
        self._publish_kv_events()
        return cleared

    def update(self, out: SchedulerOutput, result: ModelOutput) -> None:
        """The model call for ``out`` returned ``result``: apply it and publish."""
        self._publish(self.scheduler.update(out, result, self.clock()))

    def fail(self, out: SchedulerOutput, error: BaseException) -> None:
        """The model call for ``out`` raised: its requests end with ``error``; others go on."""
        self._publish(self.scheduler.fail(out, error, self.clock()))

    def _publish(self, outcome: StepOutcome) -> None:
        live, out = self.live, outcome.output
        for seqs in (out.decode_seqs, out.prefill_seqs):
            for seq in seqs:
                stream = live.get(seq.request_id)
                if stream is not None and stream.seq is seq:
                    stream.notify()
        for seq in outcome.finished:
            self._finished(seq)
        if self.observer is not None:
            self._observe(self.observer.on_step, outcome)
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Hand the prefix cache's changes since the last call to the KV-event sink (errors
        contained and counted like the observer's)."""
        cache = self.scheduler.prefix_cache
        if self.kv_events is not None and cache is not None:
            events = cache.take_events()
            if events:
                self._observe(self.kv_events.publish, events)

    def _finished(self, seq: Sequence) -> None:
        stream = self.live.get(seq.request_id)
        if stream is not None and stream.seq is seq:
            del self.live[seq.request_id]
            self.aborting.discard(seq.request_id)
            stream.notify()
        if self.observer is not None:
            self._observe(self.observer.on_finished, seq)

    def _observe(self, method: Callable[[Any], None], event: object) -> None:
        try:
            method(event)
        except Exception as err:
            kind = f"{method.__name__}:{type(err).__name__}"
            if kind not in self.observer_errors:
                log.exception("the engine's observer failed in %s (logged once per kind)", kind)
            self.observer_errors[kind] += 1
