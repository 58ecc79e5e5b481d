"""Running a workload: open or closed loop, warm-up, worker processes, the server's books.

Arrivals follow each spec's ``send_at`` (open loop: Poisson or all at once); ``concurrency``
caps the requests in flight (with all-at-once arrivals this is a closed loop: a new request
leaves when one ends). Warm-up requests run first and are not counted. With ``workers`` > 1
the specs are dealt round-robin to forked processes (a Poisson stream split this way stays a
Poisson stream of the same total rate), each with its own event loop and connections; they
start together at one ``time.monotonic()`` instant and their results are merged. The parent
polls the server (``Monitor``) and reads ``vllm:generation_tokens_total`` before and after.

Interruption: SIGINT (Ctrl-C) or SIGTERM stops a run early without losing it. Each worker stops
sending, closes the streams still in flight (the server aborts them) and hands back the requests
that ended; the run's output is then marked ``partial``. Forked workers ignore signals (a
terminal's Ctrl-C reaches the whole process group): the parent, signalled, sets a shared
``halt`` flag they watch, so a signal to the parent alone ends them cleanly too. A second signal
gives up at once (``Interrupted``; the parent kills its workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import queue
import resource
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any, Literal

import httpx

from app.bench.client import NativeTarget, OpenAITarget, RequestResult, Target, send
from app.bench.monitor import Monitor, Sample, Source, read_metric
from app.bench.workload import RequestSpec

TOKENS_METRIC = "vllm:generation_tokens_total"
SATURATED = 0.9  # a worker busier than this share of one core may be the bottleneck


class BenchError(Exception):
    """A run that cannot go on (unreachable server, bad setup); the message is one line."""


class Interrupted(Exception):
    """A second SIGINT/SIGTERM during a run: give up without a report."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Where and how to send. ``monitor`` None turns polling off."""

    url: str
    api: Literal["native", "openai"] = "native"
    model: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    concurrency: int | None = None
    workers: int = 1
    ignore_eos: bool = True
    temperature: float | None = None  # sent with every request when set
    timeout_s: float = 300.0
    monitor: Source | None = "slots"
    monitor_interval_s: float = 0.25


@dataclass(slots=True)
class WorkerOutput:
    """One worker's results and its own cost: CPU seconds over the measured part."""

    results: list[RequestResult]
    cpu_s: float
    wall_s: float
    ended: float  # time.monotonic() when its last request ended
    interrupted: bool = False  # stopped by a signal: ``results`` holds the requests that ended


@dataclass(slots=True)
class RunOutput:
    """A whole run: results in spec order, its duration, each worker's CPU share of one core,
    the server's samples and its generated-token counter delta (None if it has none)."""

    results: list[RequestResult]
    duration_s: float
    worker_cpu: list[float]
    cpu_s: float = 0.0  # the workers' CPU seconds over the measured part, summed
    samples: list[Sample] = field(default_factory=list)
    started: float = 0.0
    server_tokens: float | None = None
    monitor_error: str | None = None
    planned: int = 0  # requests the run meant to send (more than ``results`` when partial)
    partial: bool = False  # interrupted: the figures cover the requests that ended before it

    @property
    def saturated(self) -> bool:
        return any(share > SATURATED for share in self.worker_cpu)


Progress = Callable[[RequestResult], None]


def make_target(config: RunConfig) -> Target:
    if config.api == "openai":
        return OpenAITarget(config.model, config.ignore_eos, config.temperature)
    return NativeTarget(config.ignore_eos, config.temperature)


def make_client(config: RunConfig, connections: int) -> httpx.AsyncClient:
    """A client with room for every request in flight and no read timeout shorter than
    ``timeout_s`` (a long request may go a while between events on a saturated server)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    return httpx.AsyncClient(
        base_url=config.url, headers=dict(config.headers), limits=limits, timeout=timeout
    )


async def check_reachable(config: RunConfig) -> None:
    """Raise ``BenchError`` in one line if the server cannot be reached or is not serving."""
    async with make_client(config, 1) as client:
        try:
            response = await client.get("/health")
        except httpx.HTTPError as err:
            raise BenchError(f"cannot reach {config.url}: {err or type(err).__name__}") from None
    if response.status_code == 503:
        raise BenchError(f"{config.url} is not serving (/health answered 503)")


async def run_specs(
    client: httpx.AsyncClient,
    target: Target,
    specs: Sequence[RequestSpec],
    start: float,
    concurrency: int | None,
    progress: Progress | None,
    stop: asyncio.Event,
) -> list[RequestResult]:
    """Send each spec at ``start + send_at`` (later if ``concurrency`` requests are in flight)
    and return the results in spec order. Once ``stop`` is set, nothing more is sent, the
    requests in flight are cancelled (their streams closed) and only those that ended before
    are returned."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    ended: dict[int, RequestResult] = {}

    async def one(spec: RequestSpec) -> None:
        try:
            result = await send(client, target, spec)
        finally:
            if limit is not None:
                limit.release()
        ended[spec.index] = result
        if progress is not None:
            progress(result)

    async def schedule() -> None:
        for spec in specs:
            delay = start + spec.send_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is not None:
                await limit.acquire()
            tasks.append(asyncio.create_task(one(spec)))
        await asyncio.gather(*tasks)

    tasks: list[asyncio.Task[None]] = []
    scheduler = asyncio.create_task(schedule())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait((scheduler, stopped), return_when=asyncio.FIRST_COMPLETED)
    for task in (scheduler, stopped, *tasks):
        task.cancel()
    await asyncio.gather(scheduler, stopped, *tasks, return_exceptions=True)
    return [ended[spec.index] for spec in specs if spec.index in ended]


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event, also: Callable[[], None] | None = None) -> Iterator[None]:
    """While inside: the first SIGINT/SIGTERM sets ``stop`` (and calls ``also``), a second
    cancels the running task, which its ``asyncio.run`` reports as ``Interrupted``."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_signal() -> None:
        if stop.is_set():
            if task is not None:
                task.cancel("interrupted twice")
            return
        stop.set()
        if also is not None:
            also()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def drive(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec],
    concurrency: int | None,
    ready: Callable[[], Awaitable[float]],
    progress: Progress | None,
    halted: Callable[[], bool] | None = None,
) -> WorkerOutput:
    """One worker: warm up, await ``ready()`` (which returns the common start instant), send
    ``specs`` and measure its own CPU time meanwhile. It stops early on a signal (module doc)
    or, for a forked worker, which ignores signals, once ``halted()`` (its parent's word)."""
    target = make_target(config)
    stop = asyncio.Event()
    with contextlib.ExitStack() as stack:
        if halted is None:
            stack.enter_context(stop_on_signals(stop))
        else:
            watch = asyncio.create_task(_watch(halted, stop))
            stack.callback(watch.cancel)
        async with make_client(config, concurrency or max(1, len(specs))) as client:
            if warmup:
                await run_specs(client, target, warmup, time.monotonic(), concurrency, None, stop)
            start = await ready()
            cpu = time.process_time()
            results = await run_specs(client, target, specs, start, concurrency, progress, stop)
            ended = time.monotonic()
    return WorkerOutput(results, time.process_time() - cpu, ended - start, ended, stop.is_set())


async def _watch(halted: Callable[[], bool], stop: asyncio.Event) -> None:
    """Set ``stop`` once ``halted()`` (a flag shared with another process: polled)."""
    while not halted():  # noqa: ASYNC110 (another process sets it: no event to await here)
        await asyncio.sleep(0.05)
    stop.set()


def run(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec] = (),
    progress: Progress | None = None,
) -> RunOutput:
    """Run ``specs`` as ``config`` says (see the module docstring). Raises ``BenchError``."""
    raise_open_file_limit()
    asyncio.run(check_reachable(config))
    try:
        if config.workers <= 1:
            return asyncio.run(_run_here(config, specs, warmup, progress))
        return _run_forked(config, specs, warmup, progress)
    except asyncio.CancelledError:  # the second signal (stop_on_signals)
        raise Interrupted from None


class _Books:
    """The parent's side of a run: the monitor and the token counter around the measured part."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.client = make_client(config, 2)
        self.monitor: Monitor | None = None
        self.tokens_before: float | None = None
        self.started = 0.0

    async def begin(self) -> float:
        self.tokens_before = await read_metric(self.client, TOKENS_METRIC)
        if self.config.monitor is not None:
            self.monitor = Monitor(self.client, self.config.monitor, self.config.monitor_interval_s)
            self.monitor.start()
        self.started = time.monotonic()
        return self.started

    async def finish(self, outputs: list[WorkerOutput], order: Sequence[RequestSpec]) -> RunOutput:
        if self.monitor is not None:
            await self.monitor.stop()
        after = await read_metric(self.client, TOKENS_METRIC)
        await self.client.aclose()
        by_index = {r.index: r for out in outputs for r in out.results}
        delta = None
        if after is not None and self.tokens_before is not None:
            delta = after - self.tokens_before
        return RunOutput(
            results=[by_index[spec.index] for spec in order if spec.index in by_index],
            duration_s=max(out.ended for out in outputs) - self.started,
            worker_cpu=[out.cpu_s / out.wall_s if out.wall_s > 0 else 0.0 for out in outputs],
            cpu_s=sum(out.cpu_s for out in outputs),
            samples=self.monitor.samples if self.monitor else [],
            started=self.started,
            server_tokens=delta,
            monitor_error=self.monitor.error if self.monitor else None,
            planned=len(order),
            partial=any(out.interrupted for out in outputs),
        )


async def _run_here(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec],
    progress: Progress | None,
) -> RunOutput:
    books = _Books(config)
    output = await drive(config, specs, warmup, config.concurrency, books.begin, progress)
    return await books.finish([output], specs)


def _share(total: int | None, workers: int, index: int) -> int | None:
    if total is None:
        return None
    return max(1, total // workers + (1 if index < total % workers else 0))


@dataclass(frozen=True, slots=True)
class _Shared:
    """What the parent and its forked workers share: the workers' messages, ``go`` (start
    sending), ``halt`` (stop early: module doc) and ``start``, the common start instant."""

    messages: Queue[tuple[str, Any]]
    go: Event
    halt: Event
    start: Any  # a shared double (multiprocessing.Value)


def _run_forked(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec],
    progress: Progress | None,
) -> RunOutput:
    context = multiprocessing.get_context("fork")  # before any thread or event loop exists
    shared = _Shared(context.Queue(), context.Event(), context.Event(), context.Value("d", 0.0))
    n = config.workers
    processes = [
        context.Process(
            target=_worker_main,
            args=(config, specs[i::n], warmup[i::n], _share(config.concurrency, n, i), shared),
            daemon=True,
        )
        for i in range(n)
    ]
    for process in processes:
        process.start()
    try:
        return asyncio.run(_parent(config, specs, processes, shared, progress))
    except BaseException:  # given up (a second signal) or failed: the workers' work is lost
        for process in processes:
            process.kill()
        raise
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


async def _parent(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    processes: Sequence[BaseProcess],
    shared: _Shared,
    progress: Progress | None,
) -> RunOutput:
    books = _Books(config)
    ready, outputs = 0, list[WorkerOutput]()

    stop = asyncio.Event()
    with stop_on_signals(stop, shared.halt.set):  # the workers ignore signals: the parent says
        while len(outputs) < config.workers:
            if stop.is_set() and not books.started:  # nothing measured yet: nothing to report
                raise Interrupted
            kind, payload = await _next_message(shared.messages, processes)
            if kind == "ready":
                ready += 1
                if ready == config.workers:
                    shared.start.value = await books.begin()
                    shared.go.set()
            elif kind == "done" and progress is not None:
                progress(payload)
            elif kind == "output":
                outputs.append(payload)
            elif kind == "error":
                raise BenchError(f"a worker failed: {payload}")
    return await books.finish(outputs, specs)


async def _next_message(
    messages: Queue[tuple[str, Any]], processes: Sequence[BaseProcess]
) -> tuple[str, Any]:
    """The next worker message, or ``("idle", None)`` after a quiet quarter second (so the
    caller can look at its stop event); ``BenchError`` if a worker died without one."""
    try:
        message: tuple[str, Any] = await asyncio.to_thread(messages.get, timeout=0.25)
        return message
    except queue.Empty:
        dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        if dead:
            raise BenchError(f"a worker died (exit code {dead[0]})") from None
        return "idle", None


def _worker_main(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec],
    concurrency: int | None,
    shared: _Shared,
) -> None:
    messages, go, halt = shared.messages, shared.go, shared.halt

    async def ready() -> float:
        messages.put(("ready", None))
        # a process-shared Event: polled, since a thread blocked on it could not be stopped
        while not go.wait(0) and not halt.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        return float(shared.start.value)

    def done(result: RequestResult) -> None:
        messages.put(("done", RequestResult(result.index, result.group, 0, status=result.status)))

    for sig in STOP_SIGNALS:  # a terminal's Ctrl-C reaches every process: the parent decides
        signal.signal(sig, signal.SIG_IGN)
    try:
        output = asyncio.run(drive(config, specs, warmup, concurrency, ready, done, halt.is_set))
    except Exception as err:  # reported to the parent, which ends the run in one line
        messages.put(("error", f"{type(err).__name__}: {err}"))
        return
    messages.put(("output", output))


def raise_open_file_limit() -> None:
    """Allow as many connections as the hard limit does (1,000 streams need > 1,024 fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
