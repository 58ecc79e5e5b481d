"""The asyncio engine: one task owns the ``EngineCore`` and runs the decode loop.

Handlers never touch engine state. ``submit()`` registers a request and posts it to the inbox;
``abort()`` posts an abort. The loop drains the inbox at every step boundary (and awaits it when
there is no work: no polling), schedules, runs the model call (in a worker thread for a model
that blocks, so the event loop keeps streaming), sleeps on the event loop until the step
clock's deadline, then applies aborts that arrived during the step before the step's tokens, so
an aborted request's slot is free, and refilled, before the next model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import TypeVar

from app.engine.core import EngineConfig, EngineCore, EngineObserver, KVEventSink
from app.engine.errors import (
    EngineDeadError,
    EngineDrainingError,
    ModelError,
    UnsupportedFeatureError,
)
from app.engine.runner import make_runner
from app.engine.step import ModelOutput, SchedulerOutput
from app.engine.step_clock import StepClock, StepWork, sleep_until
from app.engine.stream import RequestStream
from app.engine.types import FinishReason, Sequence
from app.engine.worker import ModelWorker
from app.models.protocol import Model, shares_prompts, supports_prefix_caching

log = logging.getLogger("slotserve.engine")

STUCK_CALL_TIMEOUT = 1.0  # seconds stop() waits for a model call before abandoning it
STALL_RETRY = 0.1  # seconds between retries of failed slot resets while nothing can run
STALL_LIMIT = 10.0  # seconds with no slot to run on before the waiting requests fail
T = TypeVar("T")


class Signal(Enum):
    DRAIN = auto()  # stop admitting: abort every waiting request
    ABORT_ALL = auto()  # abort everything still running
    SHUTDOWN = auto()  # leave the loop


@dataclass(frozen=True, slots=True)
class Add:
    seq: Sequence


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    reason: FinishReason = FinishReason.ABORT


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Evict the prefix cache's free blocks; ``done`` gets whether the cache is empty."""

    done: asyncio.Future[bool]


Message = Add | Abort | Signal | ResetPrefixCache


class Engine:
    """Serves requests on a model with continuous batching. Create, ``await start()``, then
    ``submit()`` / ``abort()`` from any coroutine on the same loop; ``await stop()`` drains."""

    def __init__(
        self,
        model: Model,
        config: EngineConfig,
        observer: EngineObserver | None = None,
        kv_events: KVEventSink | None = None,
    ) -> None:
        if config.enable_prefix_caching and not supports_prefix_caching(model):
            raise UnsupportedFeatureError(
                f"prefix caching is not implemented by the model {type(model).__name__} "
                "(its runner cannot start a prefill after a cached prefix)"
            )
        if config.share_prompts and not shares_prompts(model):
            config = dataclasses.replace(config, share_prompts=False)  # n choices prefill alone
        self.model = model
        self.config = config
        self.core = EngineCore(
            make_runner(model, config.num_slots), config, observer, kv_events=kv_events
        )
        self.clock = StepClock(config.step_costs, config.seed, config.step_jitter)
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._worker: ModelWorker | None = None
        self._grammar_worker: ModelWorker | None = None  # a quick model's constrained steps
        self.draining = False
        self.death: BaseException | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._stalled_since: float | None = None
        self._last_deadline: float | None = None  # of the step just run (None: idle since)
        # requests not admissible yet (``admission_delay``, ``late_admission``): (the time they
        # reach the queue, request), in arrival order
        self._held: deque[tuple[float, Sequence]] = deque()
        self._holds = config.admission_delay > 0 or config.late_admission
        self._step_start = 0.0  # when the step just run was planned

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and self.death is None

    async def start(self) -> None:
        if self.config.offload_model_calls and getattr(self.model, "blocking", True):
            self._worker = ModelWorker()
        self._task = asyncio.create_task(self._run(), name="slotserve-engine")

    def submit(self, seq: Sequence) -> RequestStream:
        """Queue ``seq`` and return its output stream. Raises ``EngineDeadError``,
        ``EngineDrainingError``, ``DuplicateRequestError`` or ``QueueFullError`` at once."""
        if self.death is not None:
            raise EngineDeadError(f"the engine task died: {self.death!r}") from self.death
        if self.draining:
            raise EngineDrainingError()
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        stream = self.core.register(seq)
        self._idle.clear()
        self._inbox.put_nowait(Add(seq))
        return stream

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Cancel a waiting or running request (``reason``: see ``Scheduler.abort``). False if
        no live request has this id."""
        if not self.core.is_live(request_id):
            return False
        if self.core.note_abort(request_id):
            self._inbox.put_nowait(Abort(request_id, reason))
        return True

    def release_kv_hold(self, request_id: str) -> int | None:
        """Free the blocks held for a remote decoder's pull of ``request_id`` (see
        ``EngineCore.release_kv_hold``). Runs on the event loop, as the engine task does, and
        touches nothing a model call reads."""
        return self.core.release_kv_hold(request_id)

    async def reset_prefix_cache(self) -> bool:
        """Evict every cached block no running request uses, between two steps (the engine
        task owns the cache); True if the cache is now empty. False at once if the engine is
        not running."""
        if not self.alive:
            return False
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(ResetPrefixCache(done))
        return await done

    async def wait_idle(self) -> None:
        """Return once no request is waiting or running (at once after ``stop()`` or once the
        engine task has died: nothing will run any more)."""
        await self._idle.wait()

    async def stop(self, grace: float = 0.0, *, call_timeout: float = STUCK_CALL_TIMEOUT) -> None:
        """Drain: refuse new requests, abort waiting ones, let running ones finish for up to
        ``grace`` seconds, abort the rest, then end the engine task. A model call still running
        ``call_timeout`` seconds later is abandoned. Every open stream has ended on return.
        Stopping again (the lifespan after a SIGTERM drain) waits for the first stop."""
        self.draining = True
        if self._task is None:
            self._idle.set()
            return
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(grace, call_timeout))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float, call_timeout: float) -> None:
        assert self._task is not None
        if not self._task.done():
            self._inbox.put_nowait(Signal.DRAIN)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=grace)
            self._inbox.put_nowait(Signal.ABORT_ALL)
            self._inbox.put_nowait(Signal.SHUTDOWN)
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), timeout=call_timeout)
        call_abandoned = not self._task.done()
        if call_abandoned:  # a model call that never returns: give up on it
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._end_leftovers(FinishReason.ABORT, None)
        if not call_abandoned and self.death is None:  # no call is running: release the slots,
            try:  # but a release that hangs is abandoned like a stuck call
                await asyncio.wait_for(self._in_worker(self.core.release_slots), call_timeout)
            except TimeoutError:
                log.error("the model's slot release did not return in %.1f s: abandoned",
                          call_timeout)  # fmt: skip
        for worker in (self._worker, self._grammar_worker):
            if worker is not None:
                worker.shutdown()
        self._idle.set()

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a bug in the engine: report it dead rather than hang
            log.exception("engine task died")
            self._die(err)

    async def _loop(self) -> None:
        core = self.core
        while True:
            if self._held:
                self._release_held()
                if not core.has_work():
                    if not await self._wait_held():
                        return
                    continue
            if not core.has_work():
                if self._inbox.empty():  # a submitted request may still be in the inbox
                    await self._in_worker(self.core.release_slots)  # idle: usage reads 0
                if self._inbox.empty():
                    self._idle.set()
                self._last_deadline = None  # the next step does not follow one
                message = await self._next_message()
                self._idle.clear()
                if not self._handle(message):
                    return
            if not self._drain_inbox():
                return
            if self._held and not core.has_work():
                continue  # only held requests: wait for the first above
            out = core.schedule()
            if not out.empty:
                self._stalled_since = None
            else:  # work waits, but none can run now (every free slot is out of
                self._last_deadline = None
                if not await self._wait_for_room():  # service): wait, never spin
                    return
                continue
            try:
                result = await self._execute(out)
            except Exception as err:
                log.warning("model call failed for %d requests: %r", len(out.scheduled()), err)
                running = self._drain_inbox()
                core.fail(out, err)
                if not running:
                    return
            else:
                if not self._drain_inbox():
                    return
                core.update(out, result)

    async def _next_message(self) -> Message:
        """The next message, while idle. Blocks held for a remote decoder (prefill/decode
        disaggregation) expire meanwhile on time, so the KV usage shows them free."""
        core = self.core
        while True:
            expiry = core.next_hold_expiry()
            if expiry is None:
                return await self._inbox.get()
            try:
                return await asyncio.wait_for(self._inbox.get(), max(0.0, expiry - core.clock()))
            except TimeoutError:
                core.expire_holds()

    async def _wait_for_room(self) -> bool:
        """Nothing can be scheduled although requests wait (every free slot is out of service):
        wait for a message (an abort, a drain) for up to ``STALL_RETRY`` seconds, then have the
        model retry its failed slot resets. If no slot has come back after ``STALL_LIMIT``
        seconds, the waiting requests end with an error instead of waiting forever. False once
        SHUTDOWN is read."""
        try:
            message = await asyncio.wait_for(self._inbox.get(), STALL_RETRY)
        except TimeoutError:
            unavailable = await self._in_worker(self.core.retry_resets)
            self.core.set_out_of_service(unavailable)
            now = self.core.clock()
            self._stalled_since = self._stalled_since or now
            if now - self._stalled_since >= STALL_LIMIT:
                self._stalled_since = None
                error = ModelError(f"the model failed to reset slots {sorted(unavailable)}")
                log.error("%s for %.0f s: ending the waiting requests", error, STALL_LIMIT)
                self.core.fail_waiting(error)
            return True
        return self._handle(message)

    async def _in_worker(self, fn: Callable[[], T]) -> T:
        """``fn()`` where the model's calls run (its worker thread, if it has one)."""
        if self._worker is None:
            return fn()
        return await self._worker.run(fn)

    async def _execute(self, out: SchedulerOutput) -> ModelOutput:
        """The model call, then the rest of the step clock's time on the event loop (a sleep
        that nothing has to wait for: streams, submits and aborts run meanwhile). A step with
        grammar work runs in a worker thread even for a model whose calls are quick (the
        mocks): a client's grammar may cost milliseconds a token (bounded by the grammar
        budget), which must not stall the event loop."""
        core = self.core
        if self._worker is not None:
            result = await self._worker.run(core.execute, out)
        elif core.constrained(out):
            if self._grammar_worker is None:
                self._grammar_worker = ModelWorker("slotserve-grammar")
            result = await self._grammar_worker.run(core.execute, out)
        else:
            result = core.execute(out)
        if self.clock.enabled:
            work = StepWork.of(out)
            deadline = self.clock.paced_deadline(out.started_at, work, self._last_deadline)
            self._last_deadline = deadline
            await sleep_until(deadline, self.core.clock)
            self._step_start = out.started_at
        else:
            await asyncio.sleep(0)  # let streams, submits and aborts run between steps
        return result

    def _hold(self, seq: Sequence) -> None:
        """Queue ``seq`` until it is admissible (see ``EngineConfig.admission_delay``)."""
        self._held.append((seq.times.arrival + self.config.admission_delay, seq))

    def _release_held(self) -> None:
        """Hand the scheduler every held request now admissible: it reached the queue by now,
        or, with ``late_admission`` while steps run back to back, before the step just run
        was planned (as ``app.simulate.run`` does)."""
        threshold = self.core.clock()
        busy = self._last_deadline is not None and self.core.has_work()
        if self.config.late_admission and busy:
            threshold = self._step_start
        while self._held and self._held[0][0] <= threshold:
            self.core.add(self._held.popleft()[1])

    async def _wait_held(self) -> bool:
        """Nothing runs and requests are held: wait for the first to become admissible, or
        for a message. False once SHUTDOWN is read."""
        self._last_deadline = None  # idle: the next step does not follow one
        delay = max(0.0, self._held[0][0] - self.core.clock())
        try:
            message = await asyncio.wait_for(self._inbox.get(), delay)
        except TimeoutError:
            return True
        return self._handle(message)

    def _unhold(self, request_id: str | None = None) -> None:
        """Hand held requests (one, or all) to the scheduler at once, to be aborted there."""
        for entry in list(self._held):
            if request_id is None or entry[1].request_id == request_id:
                self._held.remove(entry)
                self.core.add(entry[1])

    def _drain_inbox(self) -> bool:
        """Apply every queued message; False once SHUTDOWN is read."""
        while not self._inbox.empty():
            if not self._handle(self._inbox.get_nowait()):
                return False
        return True

    def _handle(self, message: Message) -> bool:
        core = self.core
        if isinstance(message, Add):
            if self._holds:
                self._hold(message.seq)
            else:
                core.add(message.seq)
        elif isinstance(message, Abort):
            self._unhold(message.request_id)
            core.abort(message.request_id, message.reason)
        elif message is Signal.DRAIN:
            self._unhold()
            core.abort_waiting()
        elif message is Signal.ABORT_ALL:
            core.end_all()
        elif isinstance(message, ResetPrefixCache):
            if not message.done.done():
                message.done.set_result(core.reset_prefix_cache())
        elif message is Signal.SHUTDOWN:
            return False
        return True

    def _die(self, err: BaseException) -> None:
        """End every open stream with an error at once, so no consumer hangs on a dead engine."""
        self.death = err
        self._end_leftovers(FinishReason.ERROR, EngineDeadError(f"engine task died: {err!r}"))
        self._idle.set()

    def _end_leftovers(self, reason: FinishReason, error: BaseException | None) -> None:
        """With the loop gone, end every request it left: queued in the inbox, waiting or
        running in the scheduler, or known only to ``live``."""
        unqueued = [seq for _, seq in self._held]
        self._held.clear()
        while not self._inbox.empty():
            message = self._inbox.get_nowait()
            if isinstance(message, Add):
                unqueued.append(message.seq)
            elif isinstance(message, ResetPrefixCache) and not message.done.done():
                message.done.set_result(False)
        self.core.end_everything(unqueued, reason, error)
