"""Running a workload: open or closed loop, warm-up, worker processes, the server's books.

Arrivals follow each spec's ``send_at`` (open loop: Poisson or all at once); ``concurrency``
caps the requests in flight (with all-at-once arrivals this is a closed loop: a new request
leaves when one ends). Warm-up requests run first and are not counted. With ``workers`` > 1
the specs are dealt round-robin to forked processes (a Poisson stream split this way stays a
Poisson stream of the same total rate), each with its own event loop and connections; they
start together at one ``time.monotonic()`` instant and their results are merged. The parent
polls the server (``Monitor``) and reads ``vllm:generation_tokens_total`` before and after.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import resource
import time
from collections.abc import Awaitable, Callable, Sequence
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
    progress: Progress | None = None,
) -> list[RequestResult]:
    """Send each spec at ``start + send_at`` (later if ``concurrency`` requests are in flight)
    and return the results in spec order."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(spec: RequestSpec) -> RequestResult:
        try:
            result = await send(client, target, spec)
        finally:
            if limit is not None:
                limit.release()
        if progress is not None:
            progress(result)
        return result

    tasks = []
    for spec in specs:
        delay = start + spec.send_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is not None:
            await limit.acquire()
        tasks.append(asyncio.create_task(one(spec)))
    return list(await asyncio.gather(*tasks))


async def drive(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec],
    concurrency: int | None,
    ready: Callable[[], Awaitable[float]],
    progress: Progress | None,
) -> WorkerOutput:
    """One worker: warm up, await ``ready()`` (which returns the common start instant), send
    ``specs`` and measure its own CPU time meanwhile."""
    target = make_target(config)
    async with make_client(config, concurrency or max(1, len(specs))) as client:
        if warmup:
            await run_specs(client, target, warmup, time.monotonic(), concurrency)
        start = await ready()
        cpu = time.process_time()
        results = await run_specs(client, target, specs, start, concurrency, progress)
        ended = time.monotonic()
        return WorkerOutput(results, time.process_time() - cpu, ended - start, ended)


def run(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec] = (),
    progress: Progress | None = None,
) -> RunOutput:
    """Run ``specs`` as ``config`` says (see the module docstring). Raises ``BenchError``."""
    raise_open_file_limit()
    asyncio.run(check_reachable(config))
    if config.workers <= 1:
        return asyncio.run(_run_here(config, specs, warmup, progress))
    return _run_forked(config, specs, warmup, progress)


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
            results=[by_index[spec.index] for spec in order],
            duration_s=max(out.ended for out in outputs) - self.started,
            worker_cpu=[out.cpu_s / out.wall_s if out.wall_s > 0 else 0.0 for out in outputs],
            cpu_s=sum(out.cpu_s for out in outputs),
            samples=self.monitor.samples if self.monitor else [],
            started=self.started,
            server_tokens=delta,
            monitor_error=self.monitor.error if self.monitor else None,
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


def _run_forked(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec],
    progress: Progress | None,
) -> RunOutput:
    context = multiprocessing.get_context("fork")  # before any thread or event loop exists
    messages: Queue[tuple[str, Any]] = context.Queue()
    go = context.Event()
    start = context.Value("d", 0.0)
    n = config.workers
    processes = [
        context.Process(
            target=_worker_main,
            args=(
                config,
                specs[i::n],
                warmup[i::n],
                _share(config.concurrency, n, i),
                messages,
                go,
                start,
            ),
            daemon=True,
        )
        for i in range(n)
    ]
    for process in processes:
        process.start()
    try:
        return asyncio.run(_parent(config, specs, processes, messages, go, start, progress))
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


async def _parent(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    processes: Sequence[BaseProcess],
    messages: Queue[tuple[str, Any]],
    go: Event,
    start: Any,
    progress: Progress | None,
) -> RunOutput:
    books = _Books(config)
    ready, outputs = 0, list[WorkerOutput]()
    while len(outputs) < config.workers:
        try:
            kind, payload = await asyncio.to_thread(messages.get, timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise BenchError(f"a worker died (exit code {dead[0]})") from None
            continue
        if kind == "ready":
            ready += 1
            if ready == config.workers:
                start.value = await books.begin()
                go.set()
        elif kind == "done" and progress is not None:
            progress(payload)
        elif kind == "output":
            outputs.append(payload)
        elif kind == "error":
            raise BenchError(f"a worker failed: {payload}")
    return await books.finish(outputs, specs)


def _worker_main(
    config: RunConfig,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec],
    concurrency: int | None,
    messages: Queue[tuple[str, Any]],
    go: Event,
    start: Any,
) -> None:
    async def ready() -> float:
        messages.put(("ready", None))
        await asyncio.to_thread(go.wait)
        return float(start.value)

    def done(result: RequestResult) -> None:
        messages.put(("done", RequestResult(result.index, result.group, 0, status=result.status)))

    try:
        output = asyncio.run(drive(config, specs, warmup, concurrency, ready, done))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent reports it
        return
    except Exception as err:  # reported to the parent, which ends the run in one line
        messages.put(("error", f"{type(err).__name__}: {err}"))
        return
    messages.put(("output", output))


def raise_open_file_limit() -> None:
    """Allow as many connections as the hard limit does (1,000 streams need > 1,024 fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
