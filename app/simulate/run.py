"""The replay: a workload through the ``Scheduler`` and a step clock, in virtual time.

Each request is sent at its arrival time, reaches the queue ``api_s`` later (the server's API
work: HTTP, tokenization), and is scheduled by the same ``Scheduler`` the server runs. Each
step lasts what the step clock says; time then jumps to the step's end, or, when nothing is
scheduled, to the next arrival. A request's last token reaches the client ``post_s`` after
its step (detokenization, the response's end). The client gives up ``timeout`` seconds after
sending (inference-perf's HTTP client, aiohttp, has a 300 s total timeout): the request is
aborted in the server, as vLLM aborts a request whose connection closed, and counts as a
failure. A stage starts ``workload.interval`` seconds after the previous one has ended.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.step import ModelOutput
from app.engine.step_clock import StepClock, StepWork
from app.engine.types import FinishReason, Sequence
from app.simulate.workload import Workload

CLIENT_TIMEOUT = 300.0  # aiohttp's default total timeout, which inference-perf keeps
OUTPUT_TOKEN = 0  # every generated token (requests ignore EOS: no token stops them)

StepObserver = Callable[[float, float, StepWork], None]


@dataclass(frozen=True, slots=True)
class Overheads:
    """Seconds a request spends outside the scheduler: before the queue and after its last
    token."""

    api_s: float = 0.0
    post_s: float = 0.0
    # A request that reaches the engine while a step runs joins the batch one step later than
    # the next one (what the shared vLLM measurements show: TTFT ~ 3 steps + a constant).
    late_admission: bool = True


@dataclass(slots=True)
class RequestRecord:
    """One request's life in virtual seconds (``None``: never reached)."""

    sent: float
    prompt_len: int
    output_len: int = 0
    first_token: float | None = None
    last_token: float | None = None
    done: float | None = None  # the client has the whole response (or gave up: a timeout)
    failed: bool = False
    error: str = ""


@dataclass(slots=True)
class StageRun:
    """A stage's requests and its steps' inter-token gaps: ``gaps[i]`` seconds between two
    tokens of each of ``counts[i]`` decoding requests."""

    index: int
    rate: float
    duration: float
    start: float
    records: list[RequestRecord] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    end: float = 0.0
    steps: int = 0
    preemptions: int = 0


def simulate(
    workload: Workload,
    config: SchedulerConfig,
    clock: StepClock,
    overheads: Overheads = Overheads(),
    timeout: float = CLIENT_TIMEOUT,
    on_step: StepObserver | None = None,
) -> list[StageRun]:
    """Replay ``workload``; one ``StageRun`` per stage. Deterministic for a given clock seed."""
    scheduler = Scheduler(config)
    now, runs, serial = 0.0, [], 0
    longest = config.max_model_len
    for index, stage in enumerate(workload.stages):
        run = StageRun(index, stage.rate, stage.duration, now)
        runs.append(run)
        pending: deque[tuple[float, Sequence, RequestRecord]] = deque()
        for request in stage.requests:
            record = RequestRecord(run.start + request.arrival, request.prompt_len)
            run.records.append(record)
            too_long = longest is not None and request.prompt_len + request.max_tokens > longest
            if request.refused_len or too_long:
                record.failed, record.error = True, "longer than --max-model-len"
                continue
            seq = Sequence(f"r{serial}", list(request.prompt), request.max_tokens, frozenset(),
                           priority=request.priority, user=request.user)  # fmt: skip
            serial += 1
            pending.append((record.sent + overheads.api_s, seq, record))
        live: dict[str, tuple[Sequence, RequestRecord]] = {}
        deadlines: list[tuple[float, str]] = []
        last_end = ready = now  # requests that reached the queue by ``ready`` may be scheduled
        while pending or live:
            while pending and pending[0][0] <= ready:
                _, seq, record = pending.popleft()
                seq.times.arrival = record.sent
                if scheduler.add(seq, now):
                    record.failed, record.error = True, "does not fit the KV cache"
                    continue
                live[seq.request_id] = (seq, record)
                heapq.heappush(deadlines, (record.sent + timeout, seq.request_id))
            while deadlines and deadlines[0][0] <= now:
                deadline, request_id = heapq.heappop(deadlines)
                if request_id in live:
                    scheduler.abort(request_id, now)
                    record = live.pop(request_id)[1]
                    record.failed, record.error = True, "client timeout"
                    record.done = deadline  # the client gave up: its latency is the timeout
            out = scheduler.schedule(now)
            if out.empty:
                upcoming = [pending[0][0]] if pending else []
                upcoming += [deadlines[0][0]] if deadlines else []
                if not upcoming:
                    break  # nothing can run (cannot happen: a request that never fits errs)
                now = ready = max(now, min(upcoming))
                continue
            work = StepWork.of(out)
            start, now = now, now + clock.duration(work)
            ready = start if overheads.late_admission else now
            outcome = scheduler.update(out, ModelOutput([OUTPUT_TOKEN] * out.num_outputs), now)
            if on_step is not None:
                on_step(start, now, work)
            if out.decode_seqs:
                run.gaps.append(now - last_end)
                run.counts.append(len(out.decode_seqs))
            last_end = now
            run.steps += 1
            run.preemptions += len(out.preempted)
            for seq in outcome.finished:
                entry = live.pop(seq.request_id, None)
                if entry is not None:
                    _finish(seq, entry[1], overheads.post_s)
        run.end = now
        now = max(now, run.start + stage.duration) + workload.interval
    return runs


def _finish(seq: Sequence, record: RequestRecord, post_s: float) -> None:
    record.output_len = seq.num_generated
    record.first_token = seq.times.first_token
    record.last_token = seq.times.finished
    if seq.finish_reason is FinishReason.ERROR or record.last_token is None:
        record.failed, record.error = True, str(seq.error or "error")
        return
    record.done = record.last_token + post_s
