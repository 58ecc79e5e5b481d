"""Prometheus metrics, under vLLM's names so gateways, autoscalers and dashboards read them as is.

``EngineMetrics`` is the engine's observer: it counts tokens per step and, when a request ends,
records its latencies (from the sequence's timestamps) and writes one log line. Gauges are read
from the engine when scraped, so they are never stale (not even after a burst of aborts).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from app.engine.core import EngineCore
from app.engine.step import StepOutcome
from app.engine.types import FinishReason, Sequence

if TYPE_CHECKING:
    from app.kv_events.publisher import KVEventPublisher

log = logging.getLogger("slotserve.requests")
disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: dashboards do not use them

# vLLM's default buckets (vllm/v1/metrics/buckets.py), so its dashboards' quantiles read alike
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# slotserve's own step histogram keeps its finer buckets (a mock step is a few milliseconds)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50 ... up to ``max_model_len``."""
    values = (mantissa * 10**exponent for exponent in itertools.count() for mantissa in (1, 2, 5))
    return tuple(itertools.takewhile(lambda value: value <= max_model_len, values))


# Every reason ``EngineMetrics.reject`` is called with (app/serving.py).
REJECT_REASONS = ("queue_full", "duplicate_id", "draining", "engine_dead", "not_ready")

# vllm:tool_call_parser_invocations_total's labels, and its request types (vLLM's: the chat and
# Responses routes, "other" for the rest: Messages here)
TOOL_PARSER_LABELS = ("model_name", "mode", "outcome", "request_type")
REQUEST_TYPES = ("chat_completions", "responses", "other")


def export_at_zero(metric: Counter | Histogram, *label_values: Seq[str]) -> None:
    """Create ``metric``'s series for each tuple of label values now, at 0, so that it is on
    /metrics before its first event: a panel or alert then reads 0 instead of "No data"
    (Prometheus's advice on missing metrics)."""
    for values in label_values:
        metric.labels(*values)


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


class ReadOnScrape(Collector):
    """One family whose samples are read from their source when scraped: ``read()`` gives each
    sample's label values (for ``labels``) and value; ``kind`` is the family's class (a counter
    or a gauge)."""

    def __init__(
        self, kind: type[CounterMetricFamily | GaugeMetricFamily], name: str, doc: str,
        labels: Seq[str], read: Callable[[], Iterable[tuple[Seq[str], float]]],
    ) -> None:  # fmt: skip
        self.kind, self.name, self.doc, self.labels, self.read = kind, name, doc, labels, read

    def collect(self) -> Iterable[Metric]:
        family = self.kind(self.name, self.doc, labels=list(self.labels))
        for values, value in self.read():
            family.add_metric(list(values), value)
        yield family


class RankedMetrics(Collector):
    """The metrics of one or several data-parallel ranks as one set of families, each sample
    labelled ``engine="<rank>"`` (vLLM's label for an engine core, which it always sets: a
    dashboard filtering on it finds a single engine too). vLLM exports the families in
    ``UNLABELLED`` without it: so does one rank (several must tell their samples apart)."""

    UNLABELLED = frozenset({"vllm:lora_requests_info", "vllm:admission_rejections"})

    def __init__(self, registries: Seq[CollectorRegistry], deprecated: bool = False) -> None:
        self.registries = registries
        self.deprecated = deprecated

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for rank, registry in enumerate(self.registries):
            for family in registry.collect():
                target = merged.get(family.name)
                if target is None:
                    target = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = target
                alone = len(self.registries) == 1 and family.name in self.UNLABELLED
                for sample in family.samples:
                    labels = sample.labels if alone else {**sample.labels, "engine": str(rank)}
                    target.add_sample(sample.name, labels, sample.value, sample.timestamp,
                                      sample.exemplar)  # fmt: skip
        yield from merged.values()
        if self.deprecated:
            yield from _renamed(merged)


# vLLM's names before it renamed them (0.10-0.11), exported beside the new ones with
# --show-hidden-metrics-for-version, as vLLM shows metrics it has hidden: dashboards and routers
# built for older vLLM (vLLM's own example Grafana dashboard among them) find their series.
DEPRECATED_NAMES = {
    "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries": "vllm:gpu_prefix_cache_queries",
    "vllm:prefix_cache_hits": "vllm:gpu_prefix_cache_hits",
    "vllm:inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
}


def _renamed(families: dict[str, Metric]) -> Iterable[Metric]:
    """The families of ``DEPRECATED_NAMES`` again under their older names."""
    for name, old in DEPRECATED_NAMES.items():
        family = families.get(name)
        if family is None:
            continue
        copy = Metric(old, f"{family.documentation} (deprecated name)", family.type, family.unit)
        for sample in family.samples:
            copy.add_sample(sample.name.replace(name, old, 1), sample.labels, sample.value,
                            sample.timestamp, sample.exemplar)  # fmt: skip
        yield copy


@dataclass(slots=True)
class StepTotals:
    """Model calls, their seconds and the tokens they generated since start (for rates)."""

    steps: int = 0
    step_seconds: float = 0.0
    generated: int = 0


def ranked_registry(ranks: Seq[EngineMetrics], deprecated: bool = False) -> CollectorRegistry:
    """One registry exporting every rank's metrics (``RankedMetrics``; ``deprecated``: also
    under vLLM's older names)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankedMetrics([metrics.families for metrics in ranks], deprecated))
    registry.register(ranks[0].tool_parser)  # the API server's, once: no engine label
    return registry


class EngineMetrics:
    """Implements ``EngineObserver``; owns its own registry (one per app, test-friendly):
    ``families`` holds its metrics, ``registry`` exports them labelled ``engine="0"``.
    ``max_model_len`` sets the token histograms' last bucket, as vLLM's."""

    def __init__(
        self, model_name: str, num_slots: int, profile: str | None = None,
        max_model_len: int = 8192,
    ) -> None:  # fmt: skip
        self.families = CollectorRegistry()
        self.model_name = model_name
        self.num_slots = num_slots
        labels = {"model_name": model_name}
        reg, names = self.families, ["model_name"]
        tokens = token_buckets(max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg)

        def labelled(name: str, doc: str, extra: Seq[str]) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=reg)

        # the families labelled by the model's name alone hold one series each, exported at 0
        # from the start (Prometheus's advice on missing metrics): kept here as that series
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: Seq[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in a batch slot.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for a slot.")
        self.cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."
        )
        self.slots_total = gauge("slotserve:slots_total", "Batch slots.")
        self.slots_occupied = gauge("slotserve:slots_occupied", "Batch slots holding a request.")
        profile_info = Gauge(
            "slotserve:profile_info", "The GPU profile the step clock imitates (1; none: unset).",
            [*names, "profile"], registry=reg,
        )  # fmt: skip
        profile_info.labels(model_name, profile or "none").set(1)
        self.slots_out_of_service = gauge(
            "slotserve:slots_out_of_service", "Slots whose cache the model failed to reset."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens_total", "Generated tokens.")
        self.success = labelled(
            "vllm:request_success_total", "Finished requests.", ["finished_reason", "key"]
        )
        self.rejected = labelled(
            "slotserve:requests_rejected_total", "Requests refused before queueing.",
            ["reason", "key"],
        )  # fmt: skip
        self._keys: dict[str, str] = {}  # request id -> API key name, for the "key" label
        self.model_failures = counter("slotserve:model_call_failures_total", "Failed model calls.")
        self.preemptions = counter(
            "vllm:num_preemptions_total", "Requests preempted (their slot taken back)."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)."
        )
        self.injected_failures = labelled(
            "slotserve:injected_failures_total", "Failures injected on purpose.", ["type"]
        )  # app/api/faults.py: not model-call failures, not rejections
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Arrival to slot admission.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        # a request's time in a slot, split at its first token (prefill, then decode)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", "Slot admission to finish.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "Slot admission to first token.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "First token to finish.", REQUEST_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per request: first token to finish over the tokens after the first.", ITL_BUCKETS,
        )  # fmt: skip
        self.prompt_len = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", tokens
        )
        self.gen_len = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", tokens
        )
        self.prefill_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens per request that ran (prefix-cache hits not subtracted).", tokens,
        )  # fmt: skip
        # each choice of an n > 1 request is a request of its own to the engine: n is 1 here
        self.params_n = histogram("vllm:request_params_n", "The n parameter.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens parameter.", tokens
        )
        self.max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Generated tokens a request may reach (max_tokens).", tokens,
        )  # fmt: skip
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions", "Times a request was preempted.", PREEMPTION_BUCKETS
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens fed to the model per step.",
            ITERATION_TOKEN_BUCKETS,
        )  # fmt: skip
        self.cached_prompt_tokens = counter(
            "vllm:prompt_tokens_cached", "Prompt tokens found in the prefix cache."
        )
        prompt_by_source = labelled(
            "vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
            ["source"],
        )  # fmt: skip
        cached_by_source = labelled(
            "vllm:prompt_tokens_cached_by_source", "Prefix-cache hits by cache tier.", ["source"]
        )
        self.admission_rejections = labelled(
            "vllm:admission_rejections", "Requests refused by a queue limit, by reason.",
            ["reason"],
        )  # fmt: skip
        # no multimodal inputs and no KV connector here: vLLM's families for them stay at 0
        for name, doc in (
            ("vllm:mm_cache_queries", "Multimodal cache queries (none: text only)."),
            ("vllm:mm_cache_hits", "Multimodal cache hits (none: text only)."),
            ("vllm:external_prefix_cache_queries", "KV-connector cache queries (none here)."),
            ("vllm:external_prefix_cache_hits", "KV-connector cache hits (none here)."),
        ):  # fmt: skip
            counter(name, doc)
        self.step_duration = histogram(
            "slotserve:step_duration_seconds", "Decode step wall time.", STEP_BUCKETS
        )
        self.itl = WeightedHistogram(
            "vllm:inter_token_latency_seconds", "Gaps between tokens.", ITL_BUCKETS, labels
        )
        reg.register(self.itl)
        self._last_step_end: float | None = None
        self.totals = StepTotals()  # plain running sums for views that compute rates
        # the prompt tokens' sources (each series made here, so exported at 0 from the start)
        self._computed_source = prompt_by_source.labels(model_name, "local_compute")
        self._hit_source = prompt_by_source.labels(model_name, "local_cache_hit")
        self._external_source = prompt_by_source.labels(model_name, "external_kv_transfer")
        self.kv_transfer_fallbacks = labelled(
            "slotserve:kv_transfer_fallbacks",
            "P/D decode requests whose KV pull failed and that prefilled locally, by reason.",
            ["reason"],
        )  # fmt: skip
        self._device_hits = cached_by_source.labels(model_name, "device")
        # the "key" label is "" without named API keys (a named key's series start at its first use)
        export_at_zero(self.success, *[(model_name, r.value, "") for r in FinishReason])
        export_at_zero(self.rejected, *[(model_name, reason, "") for reason in REJECT_REASONS])
        export_at_zero(cached_by_source, *[(model_name, source) for source in (
            "device", "host", "p2p", "disk", "external_unspecified")])  # fmt: skip
        export_at_zero(self.admission_rejections, (model_name, "max_num_queued_reqs"),
                       (model_name, "max_num_queued_tokens"))  # fmt: skip
        # vLLM's API-server family: one per process, without the engine label (the routes count
        # it through rank 0's metrics, serving.metrics; ranked_registry exports rank 0's)
        self.tool_parser = Counter(
            "vllm:tool_call_parser_invocations", "Replies read for tool calls: once per choice "
            "(non_streaming), once per delta (streaming).", TOOL_PARSER_LABELS, registry=None,
        )  # fmt: skip
        modes, outcomes = ("streaming", "non_streaming"), ("tool_call", "no_tool_call")
        series = itertools.product([model_name], modes, outcomes, REQUEST_TYPES)
        export_at_zero(self.tool_parser, *series)
        self.registry = ranked_registry([self])  # this rank alone: engine="0"

    def bind(self, core: EngineCore) -> None:
        """Read the gauges from ``core`` at scrape time."""
        name, books, table = self.model_name, core.scheduler.books, core.scheduler.slots
        self.running.labels(name).set_function(lambda: core.num_running)
        self.waiting.labels(name).set_function(lambda: core.num_waiting)
        self.slots_occupied.labels(name).set_function(lambda: core.num_running)
        self.slots_total.labels(name).set(core.config.num_slots)
        self.cache_usage.labels(name).set_function(lambda: books.usage(table.running()))
        waiting = Gauge(
            "vllm:num_requests_waiting_by_reason", "Waiting requests by reason (capacity: "
            "waiting for a slot; deferred: none here).", ["model_name", "reason"],
            registry=self.families,
        )  # fmt: skip
        waiting.labels(name, "capacity").set_function(lambda: core.num_waiting)
        waiting.labels(name, "deferred").set(0)
        self.slots_out_of_service.labels(name).set_function(lambda: len(table.out_of_service))
        # exceptions this observer raised into the engine, which contained them (read from the
        # engine, so it counts even when metrics are broken)
        errors = ReadOnScrape(
            CounterMetricFamily, "slotserve:observer_errors",
            "Errors raised by the metrics observer (contained).", ["model_name"],
            lambda: [([name], sum(core.observer_errors.values()))],
        )  # fmt: skip
        self.families.register(errors)
        # vLLM's cache description (routers and gateways read the cache's size from its labels;
        # vLLM writes them with str(), hence "True"/"False"); value 1
        info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=self.families,
        )  # fmt: skip
        cached = books.prefix_cache is not None
        info.labels(str(books.block_size), str(books.total), str(cached)).set(1)

    def watch_loras(self, core: EngineCore, max_loras: int) -> None:
        """Export ``vllm:lora_requests_info`` read from ``core``, as vLLM exports it: one series
        whose labels name the LoRA adapters of the running and of the waiting requests (comma
        lists, sorted) and ``max_lora``, and whose value is the time it was read (routers keep
        the newest)."""

        def read() -> list[tuple[list[str], float]]:
            running = {s.lora for s in core.scheduler.slots.running() if s.lora is not None}
            waiting = {s.lora for s in core.scheduler.waiting if s.lora is not None}
            return [([str(max_loras), ",".join(sorted(waiting)), ",".join(sorted(running))],
                     time.time())]  # fmt: skip

        labels = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
        info = ReadOnScrape(GaugeMetricFamily, "vllm:lora_requests_info",
                            "Running stats on lora requests.", labels, read)  # fmt: skip
        self.families.register(info)

    def watch_kv_events(self, publisher: KVEventPublisher) -> None:
        """Export ``slotserve:kv_events_batches_total``: ``publisher``'s KV-event batches by
        outcome (``published``; ``dropped``: past the events held back for a full send queue;
        ``failed``: the send raised)."""
        name = self.model_name
        batches = ReadOnScrape(
            CounterMetricFamily, "slotserve:kv_events_batches", "KV-event batches by outcome.",
            ["model_name", "outcome"],
            lambda: [([name, "published"], publisher.published),
                     ([name, "dropped"], publisher.dropped), ([name, "failed"], publisher.errors)],
        )  # fmt: skip
        self.families.register(batches)

    def watch_sleep(self, level: Callable[[], int]) -> None:
        """Export ``vllm:engine_sleep_state`` read from ``level()`` (0: awake, 1: weights
        offloaded, 2: all discarded), one series per state set to 1 or 0."""
        gauge = Gauge(
            "vllm:engine_sleep_state", "Sleep state: awake, weights_offloaded (level 1) or "
            "discard_all (level 2), the current one 1.", ["model_name", "sleep_state"],
            registry=self.families,
        )  # fmt: skip
        for number, state in enumerate(("awake", "weights_offloaded", "discard_all")):
            gauge.labels(self.model_name, state).set_function(
                lambda number=number: float(level() == number)  # type: ignore[misc]
            )

    def reject(self, reason: str, key: str = "") -> None:
        """A request refused before queueing; ``key`` is its API key's name ("" without keys).
        A full queue is vLLM's ``max_num_queued_reqs`` admission rejection too."""
        self.rejected.labels(self.model_name, reason, key).inc()
        if reason == "queue_full":
            self.admission_rejections.labels(self.model_name, "max_num_queued_reqs").inc()

    def tool_parse(self, streaming: bool, called: bool, request_type: str) -> None:
        """One read for tool calls (of a whole choice, or of a streamed delta) in a request of
        ``request_type`` (``REQUEST_TYPES``); ``called``: it found (part of) a call."""
        mode = "streaming" if streaming else "non_streaming"
        outcome = "tool_call" if called else "no_tool_call"
        self.tool_parser.labels(self.model_name, mode, outcome, request_type).inc()

    def attribute(self, request_id: str, key: str) -> None:
        """Label the live request ``request_id``'s counters with API key name ``key``."""
        if key:
            self._keys[request_id] = key

    def on_step(self, outcome: StepOutcome) -> None:
        """One model call ended. Counts its prompt tokens (a request's prompt once, however
        often it is preempted and recomputed), generated tokens (a token for a request aborted
        during the call is not counted), preemptions, or its failure; observes the step duration
        and the inter-token latency: the time since the previous step, weighted by the decode
        requests that got a token (each continues from the previous step)."""
        out, ended = outcome.output, outcome.ended_at
        self.step_duration.observe(ended - out.started_at)
        self.totals.steps += 1
        self.totals.step_seconds += ended - out.started_at
        if out.admitted:
            admitted = sum(seq.prompt_len for seq in out.admitted)
            self.prompt_tokens.inc(admitted)
            hits = min(out.prefix_hits, admitted)  # hits of resumed requests aside
            remote = min(out.remote_tokens, admitted - hits)  # KV a P/D producer sent
            self._computed_source.inc(admitted - hits - remote)
            self._hit_source.inc(hits)
            if remote:
                self._external_source.inc(remote)
        if out.preempted:
            self.preemptions.inc(len(out.preempted))
        if out.prefix_queries:
            self.prefix_queries.inc(out.prefix_queries)
            self.prefix_hits.inc(out.prefix_hits)
            self.cached_prompt_tokens.inc(out.prefix_hits)
            self._device_hits.inc(out.prefix_hits)
        self.iteration_tokens.observe(out.num_prefill_tokens + len(out.decode_seqs))
        if outcome.error is not None:
            self.model_failures.inc()
            self._last_step_end = None
            return
        self.generation_tokens.inc(outcome.num_generated)
        self.totals.generated += outcome.num_generated
        if self._last_step_end is not None:
            self.itl.observe(ended - self._last_step_end, outcome.num_decode_generated)
        running = len(out.decode_seqs) + len(out.prefill_seqs) > len(outcome.finished)
        self._last_step_end = ended if running else None

    def on_finished(self, seq: Sequence) -> None:
        name, times = self.model_name, seq.times
        reason = seq.finish_reason.value if seq.finish_reason else "unknown"
        key = self._keys.pop(seq.request_id, "")
        self.success.labels(name, reason, key).inc()
        self.prompt_len.observe(seq.prompt_len)
        self.gen_len.observe(seq.num_generated)
        end = times.finished or times.arrival
        self.e2e.observe(end - times.arrival)
        queue = (times.admitted or end) - times.arrival
        self.queue_time.observe(queue)
        ttft = None if times.first_token is None else times.first_token - times.arrival
        if ttft is not None:
            self.ttft.observe(ttft)
        self._observe_phases(seq, end)
        log.info(
            "request=%s key=%s prompt_tokens=%d generated_tokens=%d finish_reason=%s "
            "queue_s=%.4f ttft_s=%s total_s=%.4f",
            seq.request_id, key or "-", seq.prompt_len, seq.num_generated, reason, queue,
            "-" if ttft is None else f"{ttft:.4f}", end - times.arrival,
        )  # fmt: skip

    def _observe_phases(self, seq: Sequence, end: float) -> None:
        """vLLM's per-request histograms beyond latency: its time in a slot (prefill, decode),
        time per output token, parameters, preemptions and the prompt tokens it computed."""
        times = seq.times
        for metric, value in ((self.params_n, 1), (self.params_max_tokens, seq.max_tokens),
                              (self.max_generation, seq.max_tokens),
                              (self.request_preemptions, seq.num_preemptions)):  # fmt: skip
            metric.observe(value)
        if times.admitted is None:  # refused or aborted while waiting: it never ran
            return
        self.inference_time.observe(end - times.admitted)
        self.prefill_computed.observe(seq.prompt_len)
        if times.first_token is None:
            return
        self.prefill_time.observe(times.first_token - times.admitted)
        self.decode_time.observe(end - times.first_token)
        if seq.num_generated > 1:
            self.tpot.observe((end - times.first_token) / (seq.num_generated - 1))
