"""The serving context: one engine, its model, tokenizer, metrics and settings, and the checks a
request passes before it reaches the engine. The HTTP routes hold nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.config import Settings
from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.errors import (
    DuplicateRequestError,
    EngineDrainingError,
    EngineError,
    QueueFullError,
    UnsupportedFeatureError,
)
from app.engine.policies import PolicyConfig, PolicyName
from app.engine.scheduler import BatchingPolicy
from app.engine.step_clock import StepCosts, StepTimeModel
from app.engine.stop_strings import StopStrings
from app.engine.stream import RequestStream
from app.engine.types import FinishReason, Sequence
from app.lora import LoRAError, LoRARegistry, parse_module
from app.metrics import EngineMetrics, ranked_registry
from app.models.bans import forbids_everything
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import DEFAULT_SAMPLING, Model, SamplingParams
from app.models.tokenizer import ByteTokenizer, Tokenizer
from app.structured.constraint import Constraint, ConstraintError
from app.structured.grammar import GrammarBudget, GrammarCompiler, GrammarSpend

if TYPE_CHECKING:
    from app.kv_events.publisher import KVEventPublisher

log = logging.getLogger("slotserve.serving")


class ModelLoadingError(EngineError):
    """The real model is still loading (or failed to load): nothing can be served yet."""


class ModelLoadFailedError(ModelLoadingError):
    """The real model failed to load: nothing will be served (retrying does not help)."""


class NotReadyError(EngineError):
    """The server does not take generation now: asleep (``POST /sleep``) or within
    ``--startup-delay``. ``code`` names which (``sleeping``, ``starting``)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


SLEEP_PARTS = frozenset({"weights", "kv_cache"})  # what vLLM's /wake_up?tags= may name


class InvalidRequestError(ValueError):
    """A request the model cannot take (empty prompt, unknown token id, too long for the
    context): the client's mistake. ``param`` names the field, ``code`` the kind."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


CANCEL_TIMEOUT = 5.0  # seconds DELETE waits for the engine to apply an abort (one step, usually)


@dataclass(slots=True)
class GenerationParams:
    """A validated-shape request, before the context-length and vocabulary checks."""

    prompt: list[int]
    max_tokens: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str | None = None
    priority: int = 0
    sampling: SamplingParams = DEFAULT_SAMPLING
    bad_words: list[str] = field(default_factory=list)  # text: tokenized into sampling here
    user: str | None = None  # the request's own user field
    # The named API key the request authenticated with (None: no named keys). When set, it is
    # the request's user for --policy fair (a client cannot override it) and
    # --max-priority-for bounds its priority.
    key_name: str | None = None
    # What the output must match (structured outputs, a tool call), and the request field that
    # set it (named in the 400 if it does not compile).
    constraint: Constraint | None = None
    constraint_param: str = "response_format"
    lora: str | None = None  # the LoRA adapter the request names (None: the base model)
    # The request's grammar time, shared by the choices copied from these params (n, prompts):
    # the per-request grammar budget bounds the request, not each choice.
    grammar_spend: GrammarSpend = field(default_factory=GrammarSpend)


REJECTION_REASONS: dict[type[EngineError], str] = {
    NotReadyError: "not_ready",
    QueueFullError: "queue_full",
    DuplicateRequestError: "duplicate_id",
    EngineDrainingError: "draining",
}  # the reason label of slotserve:requests_rejected_total; any other refusal: engine_dead


def context_length_error(prompt_len: int, max_tokens: int, context: int) -> InvalidRequestError:
    """A prompt plus ``max_tokens`` that does not fit in the context length."""
    return InvalidRequestError(
        f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length "
        f"of {context} tokens",
        "max_tokens", "context_length_exceeded",
    )  # fmt: skip


def build_model(settings: Settings, tokenizer: Tokenizer | None = None) -> Model:
    """The built-in mock named by ``settings.model``; with ``tokenizer`` (``--tokenizer``) it
    writes single-token words of that vocabulary and stops at its EOS."""
    language = MockLanguage(seed=settings.seed, stop_probability=settings.mock_stop_probability)
    if tokenizer is not None:
        from app.models.hf.tokenizer import HFTokenizer
        from app.models.vocabulary import word_ids

        assert isinstance(tokenizer, HFTokenizer)
        language = MockLanguage(
            tokenizer.vocab_size,
            tokenizer.eos_token_id,
            settings.seed,
            settings.mock_stop_probability,
            text=False,
            words=word_ids(tokenizer),
        )
    if settings.model == "mock":
        return MockModel(language)
    return CachedMockModel(settings.num_slots, language)


def mock_tokenizer(settings: Settings) -> Tokenizer | None:
    """``--tokenizer``'s tokenizer for the mocks (None: their byte tokenizer)."""
    if settings.tokenizer is None:
        return None
    from app.models.vocabulary import load_tokenizer

    return load_tokenizer(settings.tokenizer)


def default_kv_cache_tokens(settings: Settings) -> int:
    """Room for every slot to hold a whole context, in whole blocks: it never binds."""
    blocks_per_slot = -(-settings.max_model_len // settings.block_size)
    return settings.num_slots * blocks_per_slot * settings.block_size


def policy_config(settings: Settings) -> PolicyConfig:
    """The scheduling policy and its knobs from the settings."""
    return PolicyConfig(
        name=PolicyName(settings.policy),
        max_overtakes=settings.max_overtakes,
        preemption_threshold=settings.preemption_threshold,
        preemption_delay=settings.preemption_delay,
        mlfq_levels=settings.mlfq_levels,
        mlfq_quantum=settings.mlfq_quantum,
        mlfq_aging_seconds=settings.mlfq_aging_seconds,
        mlfq_skip_join_tokens=settings.mlfq_skip_join_tokens,
        fair_prompt_weight=settings.fair_prompt_weight,
        fair_output_weight=settings.fair_output_weight,
        fair_preemption=settings.fair_preemption,
        fair_preemption_margin=settings.fair_preemption_margin,
    )


def physics_admission(settings: Settings) -> dict[str, Any]:
    """With --model-config: the imitated server's API time before a request may be scheduled,
    and its late admission (what ``simulate`` replays; docs/fidelity.md)."""
    if settings.model_config_file is None:
        return {}
    from app.step_time.physics import DEFAULT_CALIBRATION

    return {"admission_delay": DEFAULT_CALIBRATION.api_ms / 1000, "late_admission": True}


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's limits and step clock from the settings."""
    lora_ms = settings.lora_switch_ms if settings.enable_lora else 0.0
    costs: StepTimeModel = StepCosts(
        step_ms=settings.mock_step_ms,
        prefill_token_ms=settings.mock_prefill_ms,
        decode_token_ms=settings.mock_per_seq_ms,
        lora_load_ms=lora_ms,
    )
    if settings.model_config_file is not None:  # the physics step time (app/step_time)
        from app.step_time.settings import physics_step_time

        costs = physics_step_time(
            settings.model_config_file, settings.gpu, settings.tensor_parallel_size, lora_ms / 1e3
        )
    return EngineConfig(
        num_slots=settings.num_slots,
        max_waiting=settings.max_waiting,
        policy=BatchingPolicy(settings.batching),
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_prefill_chunk=settings.max_prefill_chunk,
        block_size=settings.block_size,
        kv_cache_tokens=settings.kv_cache_tokens or default_kv_cache_tokens(settings),
        max_model_len=settings.max_model_len,
        scheduling=policy_config(settings),
        enable_prefix_caching=settings.enable_prefix_caching,
        kv_events=settings.kv_events_endpoint is not None,
        max_loras=settings.max_loras if settings.enable_lora else None,
        step_costs=costs,
        step_jitter=settings.mock_jitter,
        **physics_admission(settings),
        seed=settings.seed,
    )


def grammar_budget(settings: Settings) -> GrammarBudget:
    """The CPU time a request's grammar work may take (``--max-grammar-ms-per-*``)."""
    return GrammarBudget(settings.max_grammar_ms_per_token, settings.max_grammar_ms_per_request)


def kv_event_publisher(settings: Settings, rank: int = 0) -> KVEventPublisher | None:
    """The KV-event publisher ``--kv-events-endpoint`` asks for (None: off); its sockets are
    open on return (``KVEventsError`` if they cannot be)."""
    if settings.kv_events_endpoint is None:
        return None
    from app.kv_events.publisher import KVEventPublisher, KVEventsConfig

    config = KVEventsConfig(
        endpoint=settings.kv_events_endpoint,
        replay_endpoint=settings.kv_events_replay_endpoint,
        topic=settings.kv_events_topic,
        buffer_steps=settings.kv_events_buffer_steps,
        max_queue_size=settings.kv_events_queue_size,
        block_size=settings.block_size,
        hash_algo=settings.prefix_caching_hash_algo,
        hash_seed=settings.prefix_caching_hash_seed,
        int_hashes=settings.kv_events_int_hashes,
        encoding=settings.kv_events_encoding,
        max_replay_clients=settings.kv_events_max_replay_clients,
        host=settings.host,
    )
    return KVEventPublisher(config, rank)


class Serving:
    """Owns the engine for one server process. With a real model (``--model smollm2`` or
    ``hf:PATH``) the engine exists only once ``start`` has loaded the model in the background;
    until then ``state`` is ``loading`` and requests are refused with ``ModelLoadingError``."""

    def __init__(self, settings: Settings, model: Model | None = None) -> None:
        from app.real_model import named, wants_real_model

        self._real = model is None and wants_real_model(settings)
        self.settings = named(settings) if self._real else settings
        self.metrics = self._new_metrics()
        self.started_at = time.time()
        self.priority_limits = settings.priority_limits()
        self.api_keys = settings.api_keys()
        self.load_error: str | None = None
        self._tool_draws = random.Random(settings.seed)  # --mock-tool-call-probability
        self._loading: asyncio.Task[None] | None = None
        self._engine: Engine | None = None  # rank 0's (the only one without data parallelism)
        self.engines: list[Engine] = []  # one per data-parallel rank, once installed
        self._tokenizer: Tokenizer | None = None
        self._mock_tokenizer: Tokenizer | None = None  # --tokenizer's, for the mocks
        self._grammars: GrammarCompiler | None = None
        self.asleep: frozenset[str] = frozenset()  # the parts still asleep (see ``sleep``)
        self.sleep_level = 0
        self._ready_at = 0.0  # monotonic time --startup-delay ends (set by ``start``)
        self.loras = LoRARegistry(
            self.settings.model_name, settings.max_cpu_loras or settings.max_loras
        )
        for spec in settings.lora_modules if settings.enable_lora else ():
            try:
                self.loras.load(*parse_module(spec))
            except LoRAError as err:  # refused at start, the module named
                raise LoRAError(f"--lora-modules {spec}: {err}", err.kind) from None
        ranks = settings.data_parallel_size
        if ranks > 1 and (model is not None or self._real):
            raise UnsupportedFeatureError(
                "--data-parallel-size > 1 runs one built-in mock per rank (not a given or real "
                "model)"
            )
        # per rank: its metrics (labelled engine=<rank> on /metrics) and KV-event publisher
        self.rank_metrics = [self.metrics] + [self._new_metrics() for _ in range(1, ranks)]
        self.metrics_registry = (
            self.metrics.registry if ranks == 1 else ranked_registry(self.rank_metrics)
        )
        self.rank_events: list[KVEventPublisher | None] = []
        try:
            for rank, metrics in enumerate(self.rank_metrics):
                publisher = kv_event_publisher(self.settings, rank)
                self.rank_events.append(publisher)
                if publisher is not None:
                    metrics.watch_kv_events(publisher)
            self.kv_events = self.rank_events[0]
            if not self._real:
                tokenizer = self._mock_tokenizer = mock_tokenizer(settings)
                model = model if model is not None else build_model(settings, tokenizer)
                self._install(model, tokenizer or ByteTokenizer())
        except Exception:  # refused at start: no publisher thread is left behind
            for opened in self.rank_events:
                if opened is not None:
                    opened.close()
            raise

    def _install(
        self, model: Model, tokenizer: Tokenizer, grammars: GrammarCompiler | None = None
    ) -> None:
        self.model = model
        self._tokenizer = tokenizer
        self._grammars = grammars or GrammarCompiler(tokenizer, grammar_budget(self.settings))
        config = engine_config(self.settings)
        for rank, metrics in enumerate(self.rank_metrics):
            rank_model = model if rank == 0 else build_model(self.settings, self._mock_tokenizer)
            engine = Engine(rank_model, config, observer=metrics, kv_events=self.rank_events[rank])
            metrics.bind(engine.core)
            if self.settings.enable_lora:
                metrics.watch_loras(engine.core, self.settings.max_loras)
            self.engines.append(engine)
        self._engine = self.engines[0]

    @property
    def engine(self) -> Engine:
        """The engine; ``ModelLoadingError`` while a real model loads."""
        if self._engine is None:
            raise self._not_loaded()
        return self._engine

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for the model's vocabulary; ``ModelLoadingError`` while a real
        model loads."""
        if self._grammars is None:
            raise self._not_loaded()
        return self._grammars

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer; ``ModelLoadingError`` while a real model loads."""
        if self._tokenizer is None:
            raise self._not_loaded()
        return self._tokenizer

    def _not_loaded(self) -> ModelLoadingError:
        if self.load_error is not None:
            return ModelLoadFailedError(f"the model failed to load: {self.load_error}")
        return ModelLoadingError(f"the model {self.settings.model_name!r} is loading")

    async def precompile(self, constraint: Constraint | None, param: str) -> None:
        """Compile ``constraint`` on a worker thread (a large schema takes a while: never on the
        event loop), so ``prepare`` finds it compiled; ``InvalidRequestError`` naming ``param``
        if it does not compile."""
        if constraint is None:
            return
        try:
            await asyncio.to_thread(self.grammars.matcher, constraint)
        except ConstraintError as err:
            raise InvalidRequestError(f"{param}: {err}", param, "invalid_grammar") from None

    def mock_calls_tool(self) -> bool:
        """Whether a mock decides to call a tool for a request whose ``tool_choice`` is ``auto``
        (with ``--mock-tool-call-probability``); a real model decides by itself (False)."""
        p = self.settings.mock_tool_call_probability
        return not self._real and p > 0 and self._tool_draws.random() < p

    def priority_ignored(self, priority: int) -> bool:
        """Whether a request's ``priority`` has no effect here (a non-default priority under a
        policy other than ``priority``): the API reports it in a response header."""
        return priority != 0 and self.settings.policy != "priority"

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def ready(self) -> bool:
        return self.state == "ok"

    @property
    def state(self) -> str:
        """``ok``, or why the server does not serve: ``loading`` (a real model), ``load_failed``,
        ``draining``, ``engine_dead``, ``sleeping`` (``POST /sleep``), ``starting`` (within
        ``--startup-delay``), or ``no_slot`` (every slot is out of service: the model cannot
        reset any)."""
        if self._engine is None:
            return "loading" if self.load_error is None else "load_failed"
        if any(engine.draining for engine in self.engines):
            return "draining"
        if not all(engine.alive for engine in self.engines):
            return "engine_dead"
        if self.asleep:
            return "sleeping"
        if time.monotonic() < self._ready_at:
            return "starting"
        tables = [engine.core.scheduler.slots for engine in self.engines]
        return "no_slot" if all(len(t.out_of_service) == t.capacity for t in tables) else "ok"

    async def start(self) -> None:
        """Start the engine; with a real model, start loading it and return at once."""
        self._ready_at = time.monotonic() + self.settings.startup_delay
        if self._real:
            self._loading = asyncio.create_task(self._load_and_start(), name="slotserve-load")
        else:
            for engine in self.engines:
                await engine.start()

    async def _load_and_start(self) -> None:
        from app.models.hf import ModelLoadError
        from app.real_model import load, sized

        try:
            loaded = await load(self.settings)
        except ModelLoadError as exc:
            self.load_error = str(exc)
            log.error("model %s not loaded: %s", self.settings.model, exc)
            return
        except Exception as exc:
            self.load_error = repr(exc)
            log.exception("model %s not loaded", self.settings.model)
            return
        self.settings = sized(self.settings, loaded)
        try:  # the grammar engine's vocabulary: ~1 s for a 49k vocabulary, off the event loop
            budget = grammar_budget(self.settings)
            grammars = await asyncio.to_thread(GrammarCompiler, loaded.tokenizer, budget)
        except Exception as exc:
            self.load_error = f"the grammar engine cannot read the tokenizer: {exc!r}"
            log.exception("model %s not loaded", self.settings.model)
            return
        self._install(loaded.model, loaded.tokenizer, grammars)
        await self.engine.start()
        log.info("model %s ready", self.settings.model_name)

    async def wait_loaded(self) -> None:
        """Return once a real model has loaded (or failed to); at once for a mock."""
        if self._loading is not None:
            await asyncio.shield(self._loading)

    async def stop(self, grace: float = 0.0) -> None:
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        await asyncio.gather(*(engine.stop(grace) for engine in self.engines))
        for publisher in self.rank_events:
            if publisher is not None:
                await asyncio.to_thread(publisher.close)

    def _new_metrics(self) -> EngineMetrics:
        """One rank's metrics (vLLM's families; token buckets up to the context length)."""
        settings = self.settings
        metrics = EngineMetrics(settings.model_name, settings.num_slots, settings.profile,
                                settings.max_model_len)  # fmt: skip
        metrics.watch_sleep(lambda: self.sleep_level)
        return metrics

    def submit(self, params: GenerationParams, id_prefix: str = "gen") -> RequestStream:
        """Validate ``params`` against the model and queue the request: ``prepare`` then
        ``enqueue``."""
        return self.enqueue(self.prepare(params, id_prefix))

    def prepare(
        self, params: GenerationParams, id_prefix: str = "gen", fork_of: Sequence | None = None
    ) -> Sequence:
        """The request as a sequence, checked against the model (vocabulary, context length,
        KV capacity); ``InvalidRequestError`` if it cannot run. Nothing is queued yet.
        ``fork_of``: another choice of the same prompt, queued before it on the same rank,
        whose prompt cache it may start from (``Sequence.fork_of``)."""
        seq = self._sequence(params, id_prefix)
        seq.fork_of = fork_of
        return seq

    def enqueue(self, seq: Sequence, rank: int | None = None) -> RequestStream:
        """Queue a prepared sequence on data-parallel rank ``rank`` (None: the least loaded).
        The engine's refusal (``QueueFullError``, ``DuplicateRequestError``,
        ``EngineDrainingError``, ``EngineDeadError``) or the server's (``NotReadyError``:
        asleep, starting) is counted and raised; the API layer turns it into its HTTP answer."""
        key = (seq.user or "") if self.api_keys.enabled else ""  # a label: key names only
        try:
            self._check_awake()
            engine = self.engine if rank is None and len(self.engines) == 1 else self._pick(rank)
            if len(self.engines) > 1 and self._rank_of(seq.request_id) is not None:
                raise DuplicateRequestError(f"request id {seq.request_id!r} is already in use")
            stream = engine.submit(seq)
        except EngineError as err:
            self.metrics.reject(REJECTION_REASONS.get(type(err), "engine_dead"), key)
            raise
        self.rank_metrics[self.engines.index(engine)].attribute(stream.request_id, key)
        return stream

    def _pick(self, rank: int | None) -> Engine:
        """Rank ``rank``'s engine, or the least loaded one (fewest live requests; ties: the
        lowest rank). ``rank`` must be in range (the API checks the header)."""
        engines = self.engines or [self.engine]
        if rank is not None:
            return engines[rank]
        return min(engines, key=lambda engine: len(engine.core.live))

    def _live(self, request_id: str) -> RequestStream | None:
        """The stream of the live request ``request_id``, on whichever rank holds it."""
        rank = self._rank_of(request_id) if len(self.engines) > 1 else 0
        return None if rank is None else self.engines[rank].core.live.get(request_id)

    def rank_of(self, request_id: str) -> int | None:
        """The data-parallel rank whose engine holds the live request ``request_id``."""
        return self._rank_of(request_id)

    def has_room(self, rank: int) -> bool:
        """Whether rank ``rank``'s engine would take one more request now (``enqueue`` would
        not raise ``QueueFullError``)."""
        return self.engines[rank].core.has_room()

    def _rank_of(self, request_id: str) -> int | None:
        """The rank whose engine holds the live request ``request_id``."""
        return next((r for r, e in enumerate(self.engines) if request_id in e.core.live), None)

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model, or unset);
        ``LookupError`` if it names neither."""
        if model is None or model == self.settings.model_name:
            return None
        if self.settings.enable_lora and model in self.loras.adapters:
            return model
        raise LookupError(model)

    def _check_awake(self) -> None:
        if self.asleep:
            raise NotReadyError(
                f"the server is asleep (level {self.sleep_level}): POST /wake_up first", "sleeping"
            )
        if time.monotonic() < self._ready_at:
            raise NotReadyError("the server is starting (--startup-delay)", "starting")

    async def sleep(self, level: int) -> None:
        """vLLM's sleep mode: from now on generation is refused (503 ``sleeping``), requests in
        flight end with ``abort``, and once the engine is idle the prefix cache is emptied
        (level 1 offloads the weights and discards the KV cache, level 2 discards both: the
        mocks have no weights, so both levels do the same here and only the level is kept)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._engine is None:  # a real model still loading
            raise self._not_loaded()
        self.asleep, self.sleep_level = SLEEP_PARTS, level
        for engine in self.engines:
            for request_id in list(engine.core.live):
                engine.abort(request_id)
        for engine in self.engines:
            await engine.wait_idle()
            await engine.reset_prefix_cache()
        log.info("asleep (level %d)", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (``weights``, ``kv_cache``; None: everything) up; the server serves
        again once nothing is asleep."""
        unknown = set(tags or ()) - SLEEP_PARTS
        if unknown:
            raise ValueError(f"unknown wake-up tag {sorted(unknown)[0]!r}: weights or kv_cache")
        self.asleep = frozenset() if tags is None else self.asleep - set(tags)
        if not self.asleep:
            self.sleep_level = 0
            log.info("awake")

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a live request early with ``reason`` (``abort``; failure injection uses
        ``error``); its stream ends and its slot is free before the next model call. False if
        no live request has this id."""
        if len(self.engines) <= 1:
            return self.engine.abort(request_id, reason)
        rank = self._rank_of(request_id)
        return rank is not None and self.engines[rank].abort(request_id, reason)

    async def cancel(self, request_id: str, owner: str | None = None) -> bool:
        """Abort a live request and wait (at most ``CANCEL_TIMEOUT``) until the engine has
        applied it, so its id is free again on return. False if no live request has this id,
        or (``owner``: an API key's name) none of that key's: another key's request is left
        alone, as if it did not exist."""

        def mine(stream: RequestStream) -> bool:
            return owner is None or stream.seq.user == owner

        stream = self._live(request_id)
        own = stream is not None and mine(stream)
        streams = [stream] if stream is not None and own and self.abort(request_id) else []
        siblings = f"{request_id}~"  # the other choices (n > 1, several prompts): <id>~<k>,
        for engine in self.engines:  # live even when the first one has ended
            for sibling_id, sibling in list(engine.core.live.items()):
                if sibling_id.startswith(siblings) and mine(sibling) and self.abort(sibling_id):
                    streams.append(sibling)
        if not streams:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(s.ended() for s in streams)), CANCEL_TIMEOUT)
        return True

    def slots(self, rank: int = 0, viewer: str | None = None) -> list[dict[str, object]]:
        """Rank ``rank``'s slot table now, one entry per slot (like llama.cpp's ``/slots``).
        ``viewer``: the API key's name asking (None: no keys, every entry whole); another
        key's request shows without its ``request_id`` and ``user``."""
        engine = self.engine if rank == 0 else self.engines[rank]
        scheduler, now = engine.core.scheduler, time.monotonic()
        table, scheduling = scheduler.slots, scheduler.policy
        out_of_service = table.out_of_service
        out: list[dict[str, object]] = []
        for index in range(table.capacity):
            seq = table.get(index)
            entry: dict[str, object] = {"id": index, "is_processing": seq is not None}
            if index in out_of_service:
                entry["out_of_service"] = True
            if seq is not None:
                level = scheduling.level(seq) if scheduling is not None else None
                entry |= {
                    "request_id": seq.request_id,
                    "prompt_tokens": seq.prompt_len,
                    "n_decoded": seq.num_generated,
                    "max_tokens": seq.max_tokens,
                    "n_remain": seq.max_tokens - seq.num_generated,
                    "n_computed": seq.num_computed_tokens,
                    "prefilling": seq.prefilling,
                    "priority": seq.priority,
                    "user": seq.user,
                    "preemptions": seq.num_preemptions,
                    "age_seconds": round(now - seq.times.arrival, 6),
                }
                if level is not None:
                    entry["level"] = level
                if viewer is not None and seq.user != viewer:
                    del entry["request_id"], entry["user"]
            out.append(entry)
        return out

    def _sequence(self, params: GenerationParams, id_prefix: str) -> Sequence:
        if not params.prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt", "empty_prompt")
        self._check_vocabulary(params.prompt, "prompt")
        self._check_vocabulary(params.stop_token_ids, "stop_token_ids")
        sampling = self._sampling(params)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.tokenizer.stop_token_ids)
        text_stop = None
        if params.stop_strings:
            decoder = self.tokenizer.stream_decoder()
            text_stop = StopStrings(params.stop_strings, decoder, sampling.min_tokens)
        vocab = self.tokenizer.vocab_size
        blame = forbids_everything(sampling, stops, vocab) if sampling.constrains_choice else None
        if blame is not None:
            raise InvalidRequestError(
                f"{blame}: no token is left to sample (allowed_token_ids, logit_bias -100, "
                "bad_words and, before min_tokens, the stop tokens forbid every token)",
                blame, "invalid_value",
            )  # fmt: skip
        max_tokens = self._max_tokens(len(params.prompt), params.max_tokens)
        if sampling.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({sampling.min_tokens}) exceeds max_tokens ({max_tokens})",
                "min_tokens", "invalid_value",
            )  # fmt: skip
        constraint = None
        if params.constraint is not None:
            try:
                constraint = self.grammars.matcher(params.constraint, params.grammar_spend)
            except ConstraintError as err:
                raise InvalidRequestError(
                    f"{params.constraint_param}: {err}", params.constraint_param, "invalid_grammar"
                ) from None
        return Sequence(
            request_id=params.request_id or f"{id_prefix}-{uuid.uuid4().hex}",
            tokens=list(params.prompt),
            max_tokens=max_tokens,
            stop_token_ids=_shared_stop_set(tuple(sorted(stops))),
            priority=self._priority(params),
            sampling=sampling,
            stop=text_stop,
            constraint=constraint,
            user=params.key_name if params.key_name is not None else params.user,
            lora=params.lora,
        )

    def _sampling(self, params: GenerationParams) -> SamplingParams:
        """The request's sampling parameters, checked against the vocabulary and the model,
        with its ``bad_words`` tokenized (each alone and after a space, as vLLM does)."""
        sampling = params.sampling
        if sampling.plain and not params.bad_words:
            return sampling
        self._check_vocabulary([token for token, _ in sampling.logit_bias], "logit_bias")
        self._check_vocabulary(list(sampling.allowed_token_ids or ()), "allowed_token_ids")
        if params.bad_words:
            encode = self.tokenizer.encode
            words = {tuple(ids) for w in params.bad_words for ids in (encode(w), encode(" " + w))}
            sampling = dataclasses.replace(sampling, bad_words=tuple(w for w in words if w))
        if not supports_sampling(self.model):
            raise InvalidRequestError(
                "this model cannot honour logits processors or log probabilities (it has no "
                "step_sampled / next_tokens_for)",
                "logprobs" if sampling.logprobs is not None else "logit_bias",
                "unsupported_parameter",
            )  # fmt: skip
        return sampling

    def _priority(self, params: GenerationParams) -> int:
        """The request's priority. ``--max-priority-for``: a named key may not claim a better
        (lower) priority than its bound (400); the default, 0, becomes the bound."""
        best = None if params.key_name is None else self.priority_limits.get(params.key_name)
        if best is None or params.priority >= best:
            return params.priority
        if params.priority == 0:
            return best
        raise InvalidRequestError(
                f"priority {params.priority} is better than API key {params.key_name!r} may "
                f"claim (at best {best}; lower is better)",
                "priority", "priority_not_allowed",
            )  # fmt: skip

    def _check_vocabulary(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise InvalidRequestError(
                f"token id {bad} in {param} is outside the vocabulary [0, {vocab})",
                param, "invalid_token_id",
            )  # fmt: skip

    def output_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The most tokens a request may generate after a ``prompt_len``-token prompt:
        ``requested``, or the default capped by the room left, never past the context (a
        request asking for more is refused by ``prepare``)."""
        room = max(self.settings.max_model_len - prompt_len, 0)
        return min(room, self.settings.default_max_tokens if requested is None else requested)

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """``requested``, or the default capped by the room left; 400 past the context."""
        context = self.settings.max_model_len
        room = context - prompt_len
        max_tokens = self.output_tokens(prompt_len, None) if requested is None else requested
        books = self.engine.core.scheduler.books
        needed = prompt_len + max_tokens - 1  # the last token is never fed back
        if room >= 0 and max_tokens <= room and not books.fits_ever(needed):
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the KV cache "
                f"({books.capacity_tokens} tokens)",
                "max_tokens", "context_length_exceeded",
            )  # fmt: skip
        if room < 0 or max_tokens > room:
            raise context_length_error(prompt_len, max_tokens, context)
        return max_tokens


def supports_sampling(model: object) -> bool:
    """Whether ``model`` honours per-request logits processors and log probabilities."""
    return callable(getattr(model, "step_sampled", getattr(model, "next_tokens_for", None)))


@functools.lru_cache(maxsize=256)
def _shared_stop_set(ids: tuple[int, ...]) -> frozenset[int]:
    """One frozenset per distinct stop list (almost always just EOS), shared by requests."""
    return frozenset(ids)
