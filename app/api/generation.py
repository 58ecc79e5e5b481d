"""One internal request and one output stream, shared by the protocol adapters.

A protocol adapter (``/v1/messages``, ``/v1/responses``, ...) only translates:

1. its body into an ``InternalRequest`` (prompt ids, ``max_tokens``, sampling, stop rules,
   the output constraint, priority, user, the model the body named);
2. ``start`` submits it ONCE, through failure injection (``faults.submit``), so injected
   failures, the engine's request counters (``vllm:request_success_total``) and its log line
   are the same as on chat completions; it returns a ``Run``;
3. the ``Run``'s output is read as text deltas with stop strings cut (``texts``) and either
   streamed (``stream_response``: SSE with the send-timeout watchdog and cancel on disconnect;
   the adapter's ``EventShaper`` lays out the protocol's events, including the error event a
   failed model call ends the stream with) or awaited whole (``await_outcome``: a client that
   leaves first aborts the request; a failed model call raises ``ModelFailed``) and shaped by
   the adapter.

Nothing here knows a protocol's field names; nothing in an adapter touches the engine.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response

from app.api import faults
from app.api.deps import data_parallel_rank
from app.api.errors import APIError, generation_failed, model_not_found
from app.api.native import flag_ignored_priority
from app.api.streaming import sse_response, until_disconnected
from app.api.tool_reader import CallReader, CallStart, Piece, TextPiece, read_calls
from app.api.tools import ToolPlan
from app.engine.stop_strings import StopStringMatcher
from app.engine.stream import RequestStream
from app.engine.types import FinishReason
from app.models.protocol import DEFAULT_SAMPLING, Logprobs, SamplingParams
from app.serving import GenerationParams, Serving
from app.structured.constraint import Constraint
from app.structured.tools import ToolCall


@dataclass(slots=True)
class InternalRequest:
    """What every protocol asks the engine for, in the engine's terms."""

    prompt: list[int]
    max_tokens: int | None
    sampling: SamplingParams = DEFAULT_SAMPLING
    stop_strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    user: str | None = None  # the body's own user field (a named API key wins)
    model: str | None = None  # the model the body named: the served one, or a LoRA adapter
    stream: bool = False
    id_prefix: str = "gen"
    constraint: Constraint | None = None  # what the output must match (structured outputs)
    constraint_param: str = "response_format"  # the field that asked for it (named in a 400)
    tools: ToolPlan | None = None  # the tools offered and the choice (calls read from the reply)


@dataclass(slots=True)
class Outcome:
    """How a request ended. ``text``: the reply's content (without its tool calls);
    ``finish_reason``: ``stop`` (end of sequence or a stop string), ``length`` or ``abort``;
    ``stop_sequence``: the stop string that ended it, if one did; ``calls``: the tool calls."""

    text: str
    finish_reason: str
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class Run:
    """One submitted request: its engine stream and its text post-processing."""

    id: str
    stream: RequestStream
    stops: list[str]
    plan: ToolPlan | None = None
    grammar_param: str | None = None  # the field that set the request's grammar, if one did
    model: str = ""  # the model the reply names: the one the body named, else the served one
    created: int = field(default_factory=lambda: int(time.time()))
    matcher: StopStringMatcher = field(init=False)
    raw: list[str] = field(default_factory=list)  # decoded text before stop strings are cut
    emitted: int = 0  # characters shown so far
    # with log probabilities asked for: the generated tokens so far and their entries
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Logprobs | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.matcher = StopStringMatcher(self.stops)

    def stop_sequence(self) -> str | None:
        """The stop string the text was cut at, once one was hit."""
        if not self.matcher.hit:
            return None
        raw = "".join(self.raw)
        return next((s for s in self.stops if raw.startswith(s, self.emitted)), None)

    def outcome(self, text: str, reason: str, calls: list[ToolCall] | None = None) -> Outcome:
        seq = self.stream.seq
        return Outcome(
            text, reason, self.stop_sequence(), seq.prompt_len, seq.num_generated, calls or []
        )


class ModelFailed(Exception):
    """The request ended in error: the model call serving it failed (or a failure was injected
    as one), or the grammar engine gave up on its grammar. ``error`` is the answer: 500
    ``model_error``, or 400 ``invalid_grammar`` naming the field that set the grammar."""

    def __init__(self, run: Run) -> None:
        self.error: APIError = generation_failed(run.stream.seq.error, run.grammar_param)
        super().__init__(self.error.message)


def adapter(serving: Serving, model: str | None) -> str | None:
    """The LoRA adapter ``model`` names (None: the served model, or none named), looked up as on
    the OpenAI routes (adapters only with ``--enable-lora``); 404 ``model_not_found`` if
    ``model`` names neither."""
    try:
        return serving.adapter(model)
    except LookupError:
        raise model_not_found(str(model), serving.settings.model_name) from None


def start(request: Request, serving: Serving, internal: InternalRequest, key: str | None) -> Run:
    """Check the model name (the served model or a loaded LoRA adapter, which the request then
    runs with) and submit ``internal`` once (through failure injection); the submit's refusals
    propagate as they do on every route. ``key``: the API key's name."""
    lora = adapter(serving, internal.model)
    rank = data_parallel_rank(request, serving)
    params = GenerationParams(
        prompt=internal.prompt, max_tokens=internal.max_tokens,
        stop_token_ids=internal.stop_token_ids, stop_strings=internal.stop_strings,
        ignore_eos=internal.ignore_eos, priority=internal.priority, sampling=internal.sampling,
        user=key if key is not None else internal.user, key_name=key,
        constraint=internal.constraint, constraint_param=internal.constraint_param, lora=lora,
    )  # fmt: skip
    stream = faults.submit(
        request, serving, params, streaming=internal.stream, id_prefix=internal.id_prefix,
        model=internal.model, rank=rank,
    )  # fmt: skip
    grammar_param = internal.constraint_param if internal.constraint is not None else None
    model = internal.model or serving.settings.model_name
    return Run(
        stream.request_id, stream, internal.stop_strings, internal.tools, grammar_param, model
    )


async def texts(run: Run, serving: Serving) -> AsyncIterator[tuple[str, str | None]]:
    """(text delta, finish reason or None) pairs; the last pair has the reason. The engine
    ends a request at the step whose tokens complete a stop string; the text is cut right
    before it. A failed model call raises ``ModelFailed``."""
    decoder = serving.tokenizer.stream_decoder()
    keep_raw = bool(run.stops)
    async for delta in run.stream:
        if delta.logprobs is not None:
            run.tokens += delta.tokens
            run.logprobs += delta.logprobs
        decoded = decoder.feed(delta.tokens)
        if keep_raw:
            run.raw.append(decoded)
        text = run.matcher.feed(decoded)
        run.emitted += len(text)
        if run.matcher.hit:
            yield text, FinishReason.STOP.value
            return
        if delta.finish_reason is FinishReason.ERROR:
            raise ModelFailed(run)
        if delta.finish_reason is not None:
            tail = decoder.flush()
            run.raw.append(tail)
            shown = run.matcher.feed(tail)
            run.emitted += len(shown)
            hit = run.matcher.hit
            text += shown + run.matcher.flush()
            yield text, FinishReason.STOP.value if hit else delta.finish_reason.value
            return
        if text:
            yield text, None


async def collect(run: Run, serving: Serving) -> Outcome:
    """The whole output, its tool calls read (``ModelFailed`` if a model call failed)."""
    parts: list[str] = []
    reason = FinishReason.ABORT.value
    async for text, end in texts(run, serving):
        parts.append(text)
        reason = end or reason
    if run.plan is None:
        return run.outcome("".join(parts), reason)
    content, calls = read_calls("".join(parts), reason, run.plan)
    return run.outcome(content, reason, calls)


async def await_outcome(request: Request, run: Run, serving: Serving) -> Outcome:
    """``collect``, aborting the request if the client leaves first (``ClientGone``)."""
    return await until_disconnected(request, collect(run, serving), lambda: serving.abort(run.id))


class EventShaper(Protocol):
    """A protocol's streamed events, as encoded SSE bytes."""

    def opening(self) -> Iterable[bytes]:
        """Before any text (the protocol's start events)."""
        ...

    def text(self, delta: str) -> Iterable[bytes]:
        """One non-empty text delta."""
        ...

    def call_start(self, index: int, call: ToolCall) -> Iterable[bytes]:
        """A tool call begins (its id and name); its arguments follow."""
        ...

    def call_arguments(self, index: int, delta: str) -> Iterable[bytes]:
        """A piece of a tool call's arguments (JSON text)."""
        ...

    def closing(self, outcome: Outcome) -> Iterable[bytes]:
        """After the last text: the protocol's end events."""
        ...

    def failure(self, error: APIError) -> Iterable[bytes]:
        """The request ended in error mid-stream (``ModelFailed.error``: a failed model call, or
        the grammar engine giving up on its grammar): the protocol's error event(s), the
        stream's last."""
        ...

    def closed(self) -> None:
        """The stream is over, however it ended (the client may have left midway)."""
        ...


async def events(run: Run, serving: Serving, shaper: EventShaper) -> AsyncIterator[bytes]:
    """The SSE bytes of ``run`` laid out by ``shaper`` (tool calls read as they stream)."""
    try:
        async for event in _events(run, serving, shaper):
            yield event
    finally:
        shaper.closed()


async def _events(run: Run, serving: Serving, shaper: EventShaper) -> AsyncIterator[bytes]:
    for event in shaper.opening():
        yield event
    reader = CallReader(run.plan) if run.plan is not None else None
    parts: list[str] = []
    reason = FinishReason.ABORT.value
    try:
        async for text, end in texts(run, serving):
            reason = end or reason
            if reader is None:
                parts.append(text)
                pieces: list[Piece] = [TextPiece(text)] if text else []
            else:
                pieces = reader.feed(text, end)
            for piece in pieces:
                for event in _shaped(shaper, piece):
                    yield event
    except ModelFailed as err:
        for event in shaper.failure(err.error):
            yield event
        return
    if reader is None:
        outcome = run.outcome("".join(parts), reason)
    else:
        outcome = run.outcome(reader.content, reason, reader.calls)
    for event in shaper.closing(outcome):
        yield event


def _shaped(shaper: EventShaper, piece: Piece) -> Iterable[bytes]:
    if isinstance(piece, TextPiece):
        return shaper.text(piece.text)
    if isinstance(piece, CallStart):
        return shaper.call_start(piece.index, piece.call)
    return shaper.call_arguments(piece.index, piece.text)


def stream_response(run: Run, serving: Serving, shaper: EventShaper) -> Response:
    """``run`` streamed as SSE: the watchdog cuts off a stalled reader and the request is
    aborted however the response ends early."""
    return sse_response(events(run, serving, shaper), run.stream, serving)


def flag_priority(response: Response, serving: Serving, internal: InternalRequest) -> Response:
    """The ``x-slotserve-priority-ignored`` header, as on every generation route."""
    return flag_ignored_priority(response, serving, internal.priority)
