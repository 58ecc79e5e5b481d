"""The serving context of one server process: its engines (one per data-parallel rank), the
model they run, the checks a request passes before it reaches them, and whether it is ready.
The HTTP routes hold nothing else.

One module per job: ``validation`` (a request into engine terms), ``ranks`` (the rank group:
engines, metrics, KV-event publishers, routing), ``loading`` (the model, mock or real),
``sleep`` (sleep mode and the startup delay) and ``engine_config`` (the settings in the
engine's terms); LoRA adapters by name are ``app.lora``'s. ``Serving`` puts them together."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from app.config import Settings, priority_limits
from app.engine import errors
from app.engine.engine import Engine
from app.engine.stream import RequestStream
from app.engine.types import FinishReason, Sequence
from app.kv_transfer.node import KVTransfer
from app.lora import start_registry
from app.models.hf import is_real_model
from app.models.protocol import Model
from app.models.tokenizer import Tokenizer
from app.serving import loading, validation
from app.serving.engine_config import engine_config
from app.serving.loading import ModelLoadFailedError, ModelLoadingError
from app.serving.ranks import Ranks
from app.serving.sleep import NotReadyError, Readiness
from app.serving.validation import GenerationParams, InvalidRequestError, context_length_error
from app.structured.constraint import Constraint

__all__ = ["REJECTION_REASONS", "GenerationParams", "InvalidRequestError", "ModelLoadFailedError",
           "ModelLoadingError", "NotReadyError", "Serving", "context_length_error",
           "engine_config"]  # fmt: skip

log = logging.getLogger("slotserve.serving")

REJECTION_REASONS: dict[type[errors.EngineError], str] = {
    NotReadyError: "not_ready",
    errors.QueueFullError: "queue_full",
    errors.DuplicateRequestError: "duplicate_id",
    errors.EngineDrainingError: "draining",
}  # the reason label of slotserve:requests_rejected_total; any other refusal: engine_dead


class Serving:
    """Owns the engines of one server process. With a real model (``--model smollm2`` or
    ``hf:PATH``) they exist only once ``start`` has loaded the model in the background; until
    then ``state`` is ``loading`` and requests are refused with ``ModelLoadingError``."""

    def __init__(self, settings: Settings, model: Model | None = None) -> None:
        self._real = model is None and is_real_model(settings.model)
        self.settings = loading.named(settings) if self._real else settings
        self.started_at = time.time()
        self.api_keys = settings.api_keys()
        self.load_error: str | None = None
        self._tool_draws = random.Random(settings.seed)  # --mock-tool-call-probability
        self._loading: asyncio.Task[None] | None = None
        self._validator: validation.Validator | None = None  # set once the model is installed
        self.readiness = Readiness()
        modules = settings.lora_modules if settings.enable_lora else []
        max_cpu_loras = settings.max_cpu_loras or settings.max_loras
        self.loras = start_registry(self.settings.model_name, max_cpu_loras, modules)
        if self._real and settings.kv_transfer_config is not None:
            raise errors.UnsupportedFeatureError(
                "--kv-transfer-config simulates prefill/decode disaggregation on the mocks only "
                "(no KV moves between servers: a real model would decode from a cache it never "
                "filled)"
            )
        self.kv_transfer = KVTransfer.from_settings(self.settings)
        if settings.data_parallel_size > 1 and (model is not None or self._real):
            raise errors.UnsupportedFeatureError(
                "--data-parallel-size > 1 runs one built-in mock per rank (not a given or real "
                "model)"
            )
        self.ranks = Ranks(self.settings, lambda: self.readiness.level)  # opens the publishers
        self.metrics = self.ranks.metrics[0]  # rank 0's (the server's refusals too)
        if not self._real:
            try:
                self._install(loading.load_mock(self.settings, model))
            except Exception:  # refused at start: no publisher thread is left behind
                self.ranks.close()
                raise

    def _install(self, loaded: loading.Loaded) -> None:
        settings = self.settings
        self.ranks.install(loaded.models, engine_config(settings))
        books = self.ranks.engines[0].core.scheduler.books
        self._validator = validation.Validator(
            settings, loaded.models[0], loaded.tokenizer, loaded.grammars, books,
            priority_limits(settings.max_priority_for),
        )  # fmt: skip

    def _loaded(self) -> validation.Validator:
        """The model's checks; ``ModelLoadingError`` while a real model loads."""
        if self._validator is None:
            if self.load_error is not None:
                raise ModelLoadFailedError(f"the model failed to load: {self.load_error}")
            raise ModelLoadingError(f"the model {self.settings.model_name!r} is loading")
        return self._validator

    @property
    def engines(self) -> list[Engine]:
        """One engine per data-parallel rank (none while a real model loads)."""
        return self.ranks.engines

    @property
    def engine(self) -> Engine:
        """Rank 0's engine; ``ModelLoadingError`` while a real model loads."""
        self._loaded()
        return self.engines[0]

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer; ``ModelLoadingError`` while a real model loads."""
        return self._loaded().tokenizer

    async def precompile(self, constraint: Constraint | None, param: str) -> None:
        """``Validator.precompile``: compile ``constraint`` off the event loop."""
        await self._loaded().precompile(constraint, param)

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
    def state(self) -> str:
        """``ok``, or why the server does not serve: ``loading`` (a real model), ``load_failed``,
        ``draining``, ``engine_dead``, ``sleeping`` (``POST /sleep``), ``starting`` (within
        ``--startup-delay``), or ``no_slot`` (every slot is out of service: the model cannot
        reset any)."""
        if self._validator is None:
            return "loading" if self.load_error is None else "load_failed"
        down = self.ranks.down or self.readiness.state
        return down or ("no_slot" if self.ranks.no_slot else "ok")

    async def start(self) -> None:
        """Start the engines; with a real model, start loading it and return at once."""
        self.readiness.start(self.settings.startup_delay)
        if self._real:
            self._loading = asyncio.create_task(self._load_and_start(), name="slotserve-load")
        for engine in self.engines:
            await engine.start()

    async def _load_and_start(self) -> None:
        try:
            self.settings, loaded = await loading.load_real(self.settings)
        except ModelLoadFailedError as err:
            self.load_error = str(err)
            return
        self._install(loaded)
        await self.engine.start()
        log.info("model %s ready", self.settings.model_name)

    async def wait_loaded(self) -> None:
        """Return once a real model has loaded (or failed to); at once for a mock."""
        if self._loading is not None:
            await asyncio.shield(self._loading)

    async def stop(self, grace: float = 0.0) -> None:
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        await self.ranks.stop(grace)
        if self.kv_transfer is not None:
            await self.kv_transfer.close()

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
        seq = self._loaded().sequence(params, id_prefix)
        seq.fork_of = fork_of
        return seq

    def enqueue(self, seq: Sequence, rank: int | None = None) -> RequestStream:
        """Queue a prepared sequence on data-parallel rank ``rank`` (None: the least loaded).
        The engine's refusal (``QueueFullError``, ``DuplicateRequestError``,
        ``EngineDrainingError``, ``EngineDeadError``) or the server's (``NotReadyError``:
        asleep, starting) is counted and raised; the API layer turns it into its HTTP answer."""
        key = (seq.user or "") if self.api_keys.enabled else ""  # a label: key names only
        try:
            self.readiness.check()
            self._loaded()
            rank, stream = self.ranks.submit(seq, rank)
        except errors.EngineError as err:
            self.metrics.reject(REJECTION_REASONS.get(type(err), "engine_dead"), key)
            raise
        self.ranks.metrics[rank].attribute(stream.request_id, key)
        return stream

    def has_room(self, rank: int) -> bool:
        """Whether rank ``rank``'s engine would take one more request now (``enqueue`` would
        not raise ``QueueFullError``)."""
        return self.engines[rank].core.has_room()

    def adapter(self, model: str | None) -> str | None:
        """``LoRARegistry.named_by``: the LoRA adapter a request's ``model`` names (None: the base
        model); ``LookupError`` if it names neither."""
        return self.loras.named_by(model, self.settings.enable_lora)

    async def sleep(self, level: int) -> None:
        """``Readiness.sleep`` on every rank; ``ModelLoadingError`` while a real model loads."""
        self._loaded()
        await self.readiness.sleep(level, self.engines)

    def release_kv_hold(self, engine_id: str, request_id: str) -> int:
        """A remote decoder's pull of ``request_id``'s held blocks (``POST
        /v1/kv_transfer/fetch``): they are freed; returns the tokens they hold. ``LookupError``
        with ``unknown_engine`` (not this server's engine id, or no P/D here) or ``expired``
        (none held: never, pulled already, or past ``--kv-transfer-hold-s``)."""
        if self.kv_transfer is None or engine_id != self.kv_transfer.config.engine_id:
            raise LookupError("unknown_engine")
        for engine in self.engines:
            tokens = engine.release_kv_hold(request_id)
            if tokens is not None:
                return tokens
        raise LookupError("expired")

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a live request early with ``reason`` (``abort``; failure injection uses
        ``error``); its stream ends and its slot is free before the next model call. False if
        no live request has this id."""
        return self.ranks.abort(request_id, reason)

    def output_tokens(self, prompt_len: int, requested: int | None) -> int:
        """``validation.output_tokens`` under the current settings."""
        return validation.output_tokens(self.settings, prompt_len, requested)
