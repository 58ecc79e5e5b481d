"""Failure injection: a share of requests fails on purpose, exactly as real failures do, so that
clients, retries, circuit breakers and gateways can be tested against this server.

Contract:

- ``FaultInjector(settings, metrics)`` holds the operator's choice (``--failure-rate``,
  ``--failure-types``, ``--failure-mid-stream-rate``, ``--allow-fault-headers``) and one random
  generator seeded from ``--seed``: the same seed and the same order of requests give the same
  failures.
- ``FaultInjector.submit`` (the app's is ``app.state.faults``) takes the place of
  ``Serving.submit`` in the generation routes. The request is checked as usual first, so a real
  error (400, 404, ...) wins over an injected one. Then a
  failure is drawn (share ``--failure-rate`` of the valid requests, its type uniform from
  ``--failure-types``) or forced by ``x-slotserve-fail: TYPE``. An injected failure raises the
  ``APIError`` that the real failure raises, built by the same function, or, for
  ``server_error``, returns a stream that has already ended as a failed model call ends one, so
  the routes render it with the same code. Either way the request never reaches the engine.
- Otherwise the request is queued. A stream drawn (``--failure-mid-stream-rate``) or asked to
  (``x-slotserve-fail-after: N``) breaks after N tokens: ``BreakingStream`` aborts the request
  as a failed model call (its slot is free before the next model call) and ends with the same
  error a real model failure gives. A request that ends on its own before N tokens is not
  broken.
- Each injected failure counts once in ``slotserve:injected_failures_total{type}`` (type
  ``mid_stream`` for a break), never in ``slotserve:model_call_failures_total`` nor in
  ``slotserve:requests_rejected_total``.
- Without ``--allow-fault-headers``, either header gets a 400: no client can force a failure on
  a production-like server.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable

from fastapi import Request

from app.api.errors import (
    APIError,
    InvalidField,
    invalid_api_key,
    invalid_request,
    model_not_found,
    refusal,
)
from app.config import FAILURE_TYPES, Settings
from app.engine.errors import EngineDrainingError, QueueFullError
from app.engine.scheduler import set_status
from app.engine.stream import Delta, RequestStream
from app.engine.types import FinishReason, RequestStatus, Sequence
from app.metrics import EngineMetrics
from app.serving import GenerationParams, Serving, context_length_error

log = logging.getLogger("slotserve.faults")

FAIL_HEADER = "x-slotserve-fail"
FAIL_AFTER_HEADER = "x-slotserve-fail-after"
FAULT_HEADER_PREFIX = FAIL_HEADER.encode()  # both names start with it (ASGI: lower case)
MID_STREAM = "mid_stream"  # the metric's type for a broken stream
BROKEN = -1


class InjectedFailure(RuntimeError):
    """The failed model call an injected ``server_error`` or stream break reports."""


class FaultInjector:
    """Decides, request by request, which failure to inject (see the module's contract)."""

    def __init__(self, settings: Settings, metrics: EngineMetrics) -> None:
        self.rate = settings.failure_rate
        self.types = tuple(settings.failure_types.split(","))
        self.mid_stream_rate = settings.failure_mid_stream_rate
        self.allow_headers = settings.allow_fault_headers
        self.rng = random.Random(settings.seed)
        self._counter = metrics.injected_failures
        self._model_name = metrics.model_name
        for kind in (*FAILURE_TYPES, MID_STREAM):
            self._counter.labels(self._model_name, kind)  # exported at 0
        if self.rate or self.mid_stream_rate or self.allow_headers:
            log.warning(
                "failure injection is on: failure rate %g (%s), mid-stream rate %g, fault "
                "headers %s", self.rate, settings.failure_types, self.mid_stream_rate,
                "allowed" if self.allow_headers else "refused",
            )  # fmt: skip

    def submit(
        self,
        request: Request,
        serving: Serving,
        params: GenerationParams,
        *,
        streaming: bool,
        id_prefix: str,
        model: str | None,
        rank: int | None = None,
    ) -> RequestStream:
        """``serving.submit(params)``, unless a failure is injected (see the module's contract).
        ``model`` is the model the request named, if any (for ``model_not_found``); ``rank``
        the data-parallel rank the request asked for (None: the least loaded)."""
        forced, after = self._headers(request.scope["headers"])
        seq = serving.prepare(params, id_prefix)
        failure = forced or self.draw_failure()
        if failure is not None:  # the request never reaches the engine
            self._count(failure, seq)
            if failure == "server_error":
                return _failed_stream(seq, InjectedFailure("server_error injected by slotserve"))
            raise _error(failure, seq, serving.settings, model)
        stream = serving.enqueue(seq, rank)
        if after is None:
            after = self._draw_break(seq) if streaming else None
        if after is None:
            return stream
        return BreakingStream(stream, after, lambda: self._break(serving, seq, after))

    def draw_failure(self) -> str | None:
        """A failure type with probability ``--failure-rate`` (uniform over the types)."""
        if self.rate and self.rng.random() < self.rate:
            return self.rng.choice(self.types)
        return None

    def _draw_break(self, seq: Sequence) -> int | None:
        """With probability ``--failure-mid-stream-rate``: break after 0 to max_tokens - 1."""
        if self.mid_stream_rate and seq.max_tokens and self.rng.random() < self.mid_stream_rate:
            return self.rng.randrange(seq.max_tokens)
        return None

    def _headers(self, raw: Iterable[tuple[bytes, bytes]]) -> tuple[str | None, int | None]:
        """The failure and break point the request's (ASGI) headers ask for; 400 if they may
        not ask."""
        fail = after = None
        for key, value in raw:  # one pass over the raw headers, not two lookups
            if key.startswith(FAULT_HEADER_PREFIX):
                if key == FAIL_HEADER.encode():
                    fail = value.decode("latin-1")
                elif key == FAIL_AFTER_HEADER.encode():
                    after = value.decode("latin-1")
        if (fail is None and after is None) or self.allow_headers:
            return _failure_type(fail), _token_count(after)
        name = FAIL_HEADER if fail is not None else FAIL_AFTER_HEADER
        raise InvalidField(f"the {name} header is refused: this server injects no failures on "
                           "request (start it with --allow-fault-headers to allow that)",
                           param=name, code="fault_headers_not_allowed")  # fmt: skip

    def _break(self, serving: Serving, seq: Sequence, after: int) -> None:
        if serving.abort(seq.request_id, FinishReason.ERROR):
            seq.error = InjectedFailure(f"stream broken after {after} tokens by slotserve")
            self._count(MID_STREAM, seq)

    def _count(self, kind: str, seq: Sequence) -> None:
        self._counter.labels(self._model_name, kind).inc()
        log.info("injected failure %s into request %s", kind, seq.request_id)


def _error(failure: str, seq: Sequence, settings: Settings, model: str | None) -> APIError:
    """The error the real failure of this kind answers, on this server, for this request."""
    if failure == "rate_limit":
        return refusal(QueueFullError.for_bounds(settings.num_slots, settings.max_waiting))
    if failure == "engine_overloaded":
        return refusal(EngineDrainingError())
    if failure == "invalid_api_key":
        return invalid_api_key()
    if failure == "context_length":
        context = settings.max_model_len
        return invalid_request(context_length_error(seq.prompt_len, seq.max_tokens, context))
    assert failure == "model_not_found", failure
    return model_not_found(model or settings.model_name, settings.model_name)


def _failed_stream(seq: Sequence, error: BaseException) -> RequestStream:
    """A stream for ``seq`` that has already ended as a failed first model call ends one."""
    seq.error = error
    set_status(seq, RequestStatus.FINISHED, FinishReason.ERROR, time.monotonic())
    return RequestStream(seq)


def _failure_type(value: str | None) -> str | None:
    if value is None:
        return None
    name = value.strip().lower()
    if name not in FAILURE_TYPES:
        raise InvalidField(f"{FAIL_HEADER} must be one of {', '.join(FAILURE_TYPES)}; got "
                           f"{value!r}", param=FAIL_HEADER,
                           code="invalid_fault_header")  # fmt: skip
    return name


def _token_count(value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise InvalidField(f"{FAIL_AFTER_HEADER} must be a number of tokens (0 to 999999999); "
                           f"got {value!r}", param=FAIL_AFTER_HEADER,
                           code="invalid_fault_header")  # fmt: skip
    return int(text)


class BreakingStream(RequestStream):
    """``inner``'s output up to ``after`` tokens. Then ``cut`` is called (it aborts the request
    as a failed model call) and the stream ends with the engine's final delta, without the
    tokens generated past the break. A request that ends before ``after`` tokens ends as usual.
    """

    __slots__ = ("_cut", "_inner", "_left")

    def __init__(self, inner: RequestStream, after: int, cut: Callable[[], None]) -> None:
        super().__init__(inner.seq)
        self._inner, self._left, self._cut = inner, after, cut

    async def __anext__(self) -> Delta:
        while True:
            if self._left == 0:
                self._left = BROKEN
                self._cut()
            delta = await anext(self._inner)
            if self._left == BROKEN:  # tokens past the break are never shown
                if delta.finish_reason is None:
                    continue
                return Delta([], delta.finish_reason, delta.error)
            if delta.finish_reason is not None or len(delta.tokens) < self._left:
                self._left -= len(delta.tokens)
                return delta
            shown = delta.tokens[: self._left]
            self._left = BROKEN
            self._cut()
            if shown:
                logprobs = None if delta.logprobs is None else delta.logprobs[: len(shown)]
                return Delta(shown, logprobs=logprobs)
