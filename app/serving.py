"""The serving context: one engine, its model, tokenizer, metrics and settings, and the checks a
request passes before it reaches the engine. The HTTP routes hold nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from dataclasses import dataclass, field

from app.api.errors import APIError
from app.config import Settings
from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
)
from app.engine.scheduler import BatchingPolicy
from app.engine.stream import RequestStream
from app.engine.types import FinishReason, Sequence
from app.metrics import EngineMetrics
from app.models.cached_mock import CachedMockModel
from app.models.latency import LatencyProfile
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import Model
from app.models.tokenizer import ByteTokenizer

CANCEL_TIMEOUT = 5.0  # seconds DELETE waits for the engine to apply an abort (one step, usually)


@dataclass(slots=True)
class GenerationParams:
    """A validated-shape request, before the context-length and vocabulary checks."""

    prompt: list[int]
    max_tokens: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str | None = None
    priority: int = 0
    user: str | None = None  # the API key's name with keys configured, else the client's field


def build_model(settings: Settings) -> Model:
    """The built-in mock named by ``settings.model``, with the configured latency."""
    language = MockLanguage(seed=settings.seed, stop_probability=settings.mock_stop_probability)
    latency = LatencyProfile(
        base_ms=settings.mock_step_ms,
        per_seq_ms=settings.mock_per_seq_ms,
        per_prefill_token_ms=settings.mock_prefill_ms,
        jitter=settings.mock_jitter,
    )
    if settings.model == "mock":
        return MockModel(language, latency)
    return CachedMockModel(settings.num_slots, language, latency)


class Serving:
    """Owns the engine for one server process."""

    def __init__(self, settings: Settings, model: Model | None = None) -> None:
        self.settings = settings
        self.tokenizer = ByteTokenizer()
        self.model = model if model is not None else build_model(settings)
        self.metrics = EngineMetrics(settings.model_name, settings.num_slots)
        config = EngineConfig(
            num_slots=settings.num_slots,
            max_waiting=settings.max_waiting,
            policy=BatchingPolicy(settings.batching),
        )
        self.engine = Engine(self.model, config, observer=self.metrics)
        usage = getattr(self.model, "cache_usage", None)
        self.metrics.bind(self.engine.core, usage if callable(usage) else None)
        self.started_at = time.time()
        self.api_keys = settings.api_keys()

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def ready(self) -> bool:
        return self.engine.alive and not self.engine.draining

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self, grace: float = 0.0) -> None:
        await self.engine.stop(grace)

    def submit(self, params: GenerationParams, id_prefix: str = "gen") -> RequestStream:
        """Validate ``params`` against the model and queue the request; ``APIError`` if refused."""
        seq = self._sequence(params, id_prefix)
        key = (params.user or "") if self.api_keys.enabled else ""  # a label: key names only
        try:
            stream = self.engine.submit(seq)
        except QueueFullError as err:
            self.metrics.reject("queue_full", key)
            raise APIError(429, str(err), "overloaded_error", code="queue_full",
                           headers={"Retry-After": "1"}) from err  # fmt: skip
        except DuplicateRequestError as err:
            self.metrics.reject("duplicate_id", key)
            raise APIError(409, str(err), param="request_id", code="duplicate_request_id") from err
        except EngineDrainingError as err:
            self.metrics.reject("draining", key)
            raise APIError(503, str(err), "service_unavailable", code="draining") from err
        except EngineDeadError as err:
            self.metrics.reject("engine_dead", key)
            raise APIError(503, str(err), "service_unavailable", code="engine_dead") from err
        self.metrics.attribute(stream.request_id, key)
        return stream

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a live request early (``reason`` is ``abort``, or ``stop`` for a stop string);
        its stream ends and its slot is free before the next model call. False if unknown."""
        return self.engine.abort(request_id, reason)

    async def cancel(self, request_id: str) -> bool:
        """Abort a live request and wait (at most ``CANCEL_TIMEOUT``) until the engine has
        applied it, so its id is free again on return. False if no live request has this id."""
        stream = self.engine.core.live.get(request_id)
        if stream is None or not self.abort(request_id):
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stream.ended(), CANCEL_TIMEOUT)
        return True

    def slots(self) -> list[dict[str, object]]:
        """The slot table now, one entry per slot (like llama.cpp's ``/slots``)."""
        table, now = self.engine.core.scheduler.slots, time.monotonic()
        out: list[dict[str, object]] = []
        for index in range(table.capacity):
            seq = table.get(index)
            entry: dict[str, object] = {"id": index, "is_processing": seq is not None}
            if seq is not None:
                entry |= {
                    "request_id": seq.request_id,
                    "prompt_tokens": seq.prompt_len,
                    "n_decoded": seq.num_generated,
                    "max_tokens": seq.max_tokens,
                    "n_remain": seq.max_tokens - seq.num_generated,
                    "age_seconds": round(now - seq.times.arrival, 6),
                }
            out.append(entry)
        return out

    def _sequence(self, params: GenerationParams, id_prefix: str) -> Sequence:
        if not params.prompt:
            raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
        self._check_vocabulary(params.prompt, "prompt")
        self._check_vocabulary(params.stop_token_ids, "stop_token_ids")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.add(self.eos_token_id)
        return Sequence(
            request_id=params.request_id or f"{id_prefix}-{uuid.uuid4().hex}",
            tokens=list(params.prompt),
            max_tokens=self._max_tokens(len(params.prompt), params.max_tokens),
            stop_token_ids=_shared_stop_set(tuple(sorted(stops))),
            priority=params.priority,
        )

    def _check_vocabulary(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise APIError(400, f"token id {bad} in {param} is outside the vocabulary [0, {vocab})",
                           param=param, code="invalid_token_id")  # fmt: skip

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """``requested``, or the default capped by the room left; 400 past the context."""
        context = self.settings.max_model_len
        room = context - prompt_len
        max_tokens = min(self.settings.default_max_tokens, max(room, 0))
        if requested is not None:
            max_tokens = requested
        if room < 0 or max_tokens > room:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                           f"exceeds the context length of {context} tokens",
                           param="max_tokens", code="context_length_exceeded")  # fmt: skip
        return max_tokens


@functools.lru_cache(maxsize=256)
def _shared_stop_set(ids: tuple[int, ...]) -> frozenset[int]:
    """One frozenset per distinct stop list (almost always just EOS), shared by requests."""
    return frozenset(ids)
