"""Prometheus metrics, under vLLM's names so gateways, autoscalers and dashboards read them as is.

``EngineMetrics`` is the engine's observer: it counts tokens per step and, when a request ends,
records its latencies (from the sequence's timestamps) and writes one log line. Gauges are read
from the engine when scraped, so they are never stale (not even after a burst of aborts).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from app.engine.core import EngineCore
from app.engine.scheduler import StepPlan
from app.engine.types import Sequence

log = logging.getLogger("slotserve.requests")
disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: dashboards do not use them

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class WeightedHistogram(Collector):
    """A histogram that records one value ``count`` times in O(log buckets): a decode step gives
    every continuing request the same inter-token gap, so it is observed once per step."""

    def __init__(self, name: str, doc: str, buckets: Seq[float], labels: dict[str, str]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = [*buckets, float("inf")]
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        if count > 0:
            self.counts[bisect.bisect_left(self.bounds, value)] += count
            self.total += value * count

    def collect(self) -> Iterable[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric(list(self.labels.values()), buckets, self.total)
        yield family


class EngineMetrics:
    """Implements ``EngineObserver``; owns its own registry (one per app, test-friendly)."""

    def __init__(self, model_name: str, num_slots: int) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.num_slots = num_slots
        labels = {"model_name": model_name}
        reg, names = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg)

        def counter(name: str, doc: str, extra: Seq[str] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets: Seq[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg)

        self.running = gauge("vllm:num_requests_running", "Requests in a batch slot.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for a slot.")
        self.cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of slot caches in use.")
        self.slots_total = gauge("slotserve:slots_total", "Batch slots.")
        self.slots_occupied = gauge("slotserve:slots_occupied", "Batch slots holding a request.")
        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens_total", "Generated tokens.")
        self.success = counter(
            "vllm:request_success_total", "Finished requests.", ["finished_reason", "key"]
        )
        self.rejected = counter(
            "slotserve:requests_rejected_total", "Requests refused before queueing.",
            ["reason", "key"],
        )  # fmt: skip
        self._keys: dict[str, str] = {}  # request id -> API key name, for the "key" label
        self.model_failures = counter("slotserve:model_call_failures_total", "Failed model calls.")
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Arrival to slot admission.", LATENCY_BUCKETS
        )
        self.prompt_len = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.gen_len = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.step_duration = histogram(
            "slotserve:step_duration_seconds", "Decode step wall time.", ITL_BUCKETS
        )
        self.itl = WeightedHistogram(
            "vllm:inter_token_latency_seconds", "Gaps between tokens.", ITL_BUCKETS, labels
        )
        reg.register(self.itl)
        self._last_step_end: float | None = None
        self._step_duration = self.step_duration.labels(model_name)
        self._prompt_tokens = self.prompt_tokens.labels(model_name)
        self._generation_tokens = self.generation_tokens.labels(model_name)

    def bind(self, core: EngineCore, cache_usage: Callable[[], float] | None = None) -> None:
        """Read the gauges from ``core`` at scrape time."""
        name = self.model_name
        self.running.labels(name).set_function(lambda: core.num_running)
        self.waiting.labels(name).set_function(lambda: core.num_waiting)
        self.slots_occupied.labels(name).set_function(lambda: core.num_running)
        self.slots_total.labels(name).set(core.config.num_slots)
        usage = cache_usage or (lambda: core.num_running / core.config.num_slots)
        self.cache_usage.labels(name).set_function(usage)

    def reject(self, reason: str, key: str = "") -> None:
        """A request refused before queueing; ``key`` is its API key's name ("" without keys)."""
        self.rejected.labels(self.model_name, reason, key).inc()

    def attribute(self, request_id: str, key: str) -> None:
        """Label the live request ``request_id``'s counters with API key name ``key``."""
        if key:
            self._keys[request_id] = key

    def on_step(self, plan: StepPlan, ended: float) -> None:
        """One model call ended at ``ended``. Counts its prefill and generated tokens (a token
        for a request aborted during the call is not counted) or its failure, and observes the
        step duration and the inter-token latency: the time since the previous step, weighted
        by the sequences that got a token in both steps."""
        self._step_duration.observe(ended - plan.started_at)
        if plan.admitted:
            self._prompt_tokens.inc(sum(seq.prompt_len for seq in plan.admitted))
        if plan.error is not None:
            self.model_failures.labels(self.model_name).inc()
            self._last_step_end = None
            return
        self._generation_tokens.inc(plan.applied)
        if self._last_step_end is not None:
            self.itl.observe(ended - self._last_step_end, len(plan.batch) - len(plan.admitted))
        self._last_step_end = ended if len(plan.batch) > len(plan.finished) else None

    def on_finished(self, seq: Sequence) -> None:
        name, times = self.model_name, seq.times
        reason = seq.finish_reason.value if seq.finish_reason else "unknown"
        key = self._keys.pop(seq.request_id, "")
        self.success.labels(name, reason, key).inc()
        self.prompt_len.labels(name).observe(seq.prompt_len)
        self.gen_len.labels(name).observe(seq.num_generated)
        end = times.finished or times.arrival
        self.e2e.labels(name).observe(end - times.arrival)
        queue = (times.admitted or end) - times.arrival
        self.queue_time.labels(name).observe(queue)
        ttft = None if times.first_token is None else times.first_token - times.arrival
        if ttft is not None:
            self.ttft.labels(name).observe(ttft)
        log.info(
            "request=%s key=%s prompt_tokens=%d generated_tokens=%d finish_reason=%s "
            "queue_s=%.4f ttft_s=%s total_s=%.4f",
            seq.request_id, key or "-", seq.prompt_len, seq.num_generated, reason, queue,
            "-" if ttft is None else f"{ttft:.4f}", end - times.arrival,
        )  # fmt: skip
