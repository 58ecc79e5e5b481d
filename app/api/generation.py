"""One generation path under every protocol: chat, completions, ``/generate``, Responses and
Messages are event shapers over it.

A protocol module only translates:

1. its body into an ``InternalRequest`` (prompts, ``n``, ``max_tokens``, sampling, stop rules,
   the output constraint, the tools offered, priority, user, the model the body named);
2. ``start`` submits it (through failure injection, ``FaultInjector.submit``, so injected failures,
   the engine's request counters and its log line are the same on every route), then its other
   choices (``n``, several prompts) as requests of their own that fork from their prompt's
   first; it returns a ``Run``;
3. the ``Run``'s output is read here, once for every protocol: per choice, text ``Piece``s with
   stop strings cut (``StopStringMatcher`` with ``min_tokens``, as the engine's stop
   condition), the tokens (and log probabilities) whose text each piece shows
   (``AlignedTokens``), tool calls read as they stream (``CallReader``) or from the whole reply
   (``read_calls``), usage. It is either streamed (``stream_response``: SSE with the
   send-timeout watchdog and cancel on disconnect; the protocol's ``EventShaper`` lays out the
   events, including the error event a failed model call ends the stream with) or awaited whole
   (``whole_reply``: a client that leaves first aborts the request; a failed model call
   raises its ``APIError``) and laid out by the protocol.

Nothing here knows a protocol's field names; nothing in a protocol module touches the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from app.api import faults
from app.api.aligned_tokens import AlignedTokens
from app.api.deps import data_parallel_rank
from app.api.errors import APIError, InvalidField, generation_failed, model_not_found
from app.api.streaming import EventStream, until_disconnected
from app.api.tool_reader import CallReader, CallStart, Part, TextPiece, read_calls
from app.api.tools import ToolPlan
from app.engine.stop_strings import StopStringMatcher
from app.engine.stream import RequestStream
from app.engine.types import FinishReason
from app.models.protocol import Logprobs
from app.serving import GenerationParams, Serving
from app.structured.tools import ToolCall


@dataclass(slots=True)
class InternalRequest(GenerationParams):
    """What every protocol asks the engine for, in the engine's terms: its first prompt's
    ``GenerationParams`` (``user``: the body's own field, a named API key wins; ``request_id``:
    the client's own id (/generate), else one is made; ``remote_decode``, ``remote_tokens``:
    prefill/decode disaggregation, app/api/kv_transfer.py), plus what the API layer reads."""

    model: str | None = None  # the model the body named: the served one, or a LoRA adapter
    stream: bool = False
    id_prefix: str = "gen"
    tools: ToolPlan | None = None  # the tools offered and the choice (calls read from the reply)
    more_prompts: list[list[int]] = field(default_factory=list)  # completions' further prompts
    n: int = 1  # choices per prompt


@dataclass(slots=True)
class Piece:
    """A part of one choice's reply: its text, the tokens it came from (with their log
    probabilities when asked for: only those whose text it shows) and, on the last one, the
    finish reason."""

    text: str
    reason: str | None
    tokens: list[int]
    logprobs: list[Logprobs | None] | None = None
    index: int = 0  # the choice it belongs to
    # what ended the choice, as vLLM's stop_reason: a stop string, or a stop_token_ids id
    stop: str | int | None = None


@dataclass(slots=True)
class Outcome:
    """How one choice ended. ``text``: the reply's content (without its tool calls);
    ``finish_reason``: ``stop`` (end of sequence or a stop string), ``length`` or ``abort``;
    ``stop_sequence``: the stop string that ended it, if one did (or the ``stop_token_ids``
    id, on the OpenAI routes that take them: vLLM's ``stop_reason``); ``calls``: the tool calls;
    ``tokens`` and ``logprobs``: the tokens the text shows (log probabilities when asked)."""

    text: str
    finish_reason: str
    stop_sequence: str | int | None
    prompt_tokens: int
    completion_tokens: int
    calls: list[ToolCall] = field(default_factory=list)
    index: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Logprobs | None] | None = None


@dataclass(slots=True)
class Choice:
    """One choice in flight: its engine stream and its text post-processing."""

    index: int
    stream: RequestStream
    matcher: StopStringMatcher
    reader: CallReader | None  # streamed with tools: the calls read as they come
    texts: list[str] = field(default_factory=list)  # the text shown so far
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Logprobs | None] | None = None
    reason: str = FinishReason.ABORT.value
    stop: str | int | None = None  # the last piece's

    def outcome(self, plan: ToolPlan | None) -> Outcome:
        """The choice's outcome once it has ended (its calls read from the whole reply, or as
        its ``reader`` streamed them)."""
        view = self.stream.view
        text, calls = "".join(self.texts), []
        if self.reader is not None:
            text, calls = self.reader.content, self.reader.calls
        elif plan is not None:
            text, calls = read_calls(text, self.reason, plan)
        return Outcome(text, self.reason, self.stop, view.prompt_len,
                       view.num_generated, calls, self.index, self.tokens,
                       self.logprobs)  # fmt: skip


@dataclass(slots=True)
class Run:
    """One submitted request: one choice per engine request (choice ``k`` answers prompt
    ``k // n``)."""

    id: str
    choices: list[Choice]
    plan: ToolPlan | None = None
    grammar_param: str | None = None  # the field that set the request's grammar, if one did
    model: str = ""  # the model the reply names: the one the body named, else the served one
    top: int | None = None  # alternatives per token when log probabilities were asked for
    n: int = 1  # choices per prompt
    # the stop_token_ids a choice's stop_reason names (not end of sequence, checked first)
    stop_ids: frozenset[int] = frozenset()
    request_type: str = "other"  # the tool-parser counter's label (app.metrics.REQUEST_TYPES)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def stream(self) -> RequestStream:
        """Choice 0's stream (the prompt's facts when there is one prompt)."""
        return self.choices[0].stream

    @property
    def streams(self) -> list[RequestStream]:
        return [choice.stream for choice in self.choices]

    def abort(self, serving: Serving) -> None:
        """End every choice still running (client gone, or another choice failed)."""
        for stream in self.streams:
            if stream.view.finish_reason is None:
                serving.abort(stream.request_id)

    def usage(self) -> tuple[int, int]:
        """(prompt tokens, generated tokens): each prompt once, every choice's tokens."""
        prompt = sum(stream.view.prompt_len for stream in self.streams[:: self.n])
        return prompt, sum(stream.view.num_generated for stream in self.streams)


class ModelFailed(Exception):
    """A choice ended in error: the model call serving it failed (or a failure was injected as
    one), or the grammar engine gave up on its grammar. ``error`` is the answer: 500
    ``model_error``, or 400 ``invalid_grammar`` naming the field that set the grammar."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


def adapter(serving: Serving, model: str | None) -> str | None:
    """The LoRA adapter ``model`` names (None: the served model, or none named); 404
    ``model_not_found`` if ``model`` names neither (adapters only with ``--enable-lora``)."""
    try:
        return serving.adapter(model)
    except LookupError:
        raise model_not_found(str(model), serving.settings.model_name) from None


def start(request: Request, serving: Serving, internal: InternalRequest, key: str | None) -> Run:
    """Check the model name (the served model or a loaded LoRA adapter, which the request then
    runs with) and the choices' room, submit ``internal`` (through failure injection) and its
    other choices; the submit's refusals propagate as they do on every route. ``key``: the API
    key's name."""
    lora = adapter(serving, internal.model)
    rank = data_parallel_rank(request, serving)
    prompts = [internal.prompt, *internal.more_prompts]
    check_room(serving, len(prompts), internal.n, rank)
    params = engine_params(internal, lora, key)
    injector: faults.FaultInjector = request.app.state.faults
    stream = injector.submit(
        request, serving, params, streaming=internal.stream, id_prefix=internal.id_prefix,
        model=internal.model, rank=rank,
    )  # fmt: skip
    streams = [stream, *_fan_out(serving, params, stream, prompts, internal.n, rank)]
    top = internal.sampling.logprobs
    min_tokens = internal.sampling.min_tokens
    choices = [
        Choice(i, each, StopStringMatcher(internal.stop_strings, min_tokens),
               CallReader(internal.tools) if internal.tools and internal.stream else None,
               logprobs=None if top is None else [])
        for i, each in enumerate(streams)
    ]  # fmt: skip
    grammar_param = internal.constraint_param if internal.constraint is not None else None
    model = internal.model or serving.settings.model_name
    eos = frozenset() if internal.ignore_eos else serving.tokenizer.stop_token_ids
    stop_ids = frozenset(internal.stop_token_ids) - eos
    return Run(stream.request_id, choices, internal.tools, grammar_param, model, top, internal.n,
               stop_ids, REQUEST_TYPE_BY_PREFIX.get(internal.id_prefix, "other"))  # fmt: skip


# vLLM's request types (its tool-parser counter's label) of the routes that offer tools, by the id
# prefix each route gives its requests (Messages: "other")
REQUEST_TYPE_BY_PREFIX = {"chatcmpl": "chat_completions", "resp": "responses"}


def engine_params(internal: InternalRequest, lora: str | None, key: str | None) -> GenerationParams:
    """``internal``'s first prompt as the engine's ``GenerationParams`` (``lora``: the adapter it
    runs with; ``key``: the API key's name, which wins over the body's ``user``)."""
    shared = {f.name: getattr(internal, f.name) for f in dataclasses.fields(GenerationParams)}
    user = key if key is not None else internal.user
    return GenerationParams(**shared | {"user": user, "key_name": key, "lora": lora})


def check_room(serving: Serving, prompts: int, n: int, rank: int | None) -> None:
    """400 when ``prompts * n`` engine requests exceed what their ranks can ever hold (slots +
    waiting bound): a retry could never succeed, so it is not a 429."""
    settings = serving.settings
    ranks = 1 if rank is not None else settings.data_parallel_size
    room = ranks * (settings.num_slots + settings.max_waiting)
    if prompts * n > room:
        raise InvalidField(f"{prompts} prompt(s) x n={n} = {prompts * n} sequences exceed what "
                           f"this server can ever hold at once ({room}: slots + --max-waiting)",
                           param="n", code="invalid_value")  # fmt: skip


def _fan_out(
    serving: Serving,
    params: GenerationParams,
    first: RequestStream,
    prompts: list[list[int]],
    n: int,
    rank: int | None,
) -> list[RequestStream]:
    """Choices 1 .. len(prompts) * n - 1 of a request as requests of their own: choice ``k``
    answers prompt ``k // n`` (OpenAI's numbering), id ``<id>~<k>``, seed ``seed + k % n`` when
    seeded (each prompt's choices draw as that prompt alone would), on data-parallel rank
    ``rank`` (None: the least loaded). Each prompt's choices after its first fork from that
    first one in the scheduler (its prompt is prefilled once; ``_enqueue_choice``). If one is
    refused, the others are aborted."""
    if len(prompts) * n == 1 or first.view.finish_reason is not None:  # (an injected failure)
        return []
    seed = params.sampling.seed
    choices = [first]
    try:
        for k in range(1, len(prompts) * n):
            i = k % n
            sampling = dataclasses.replace(params.sampling, seed=None if seed is None else seed + i)
            sibling = dataclasses.replace(
                params, prompt=prompts[k // n], request_id=f"{first.request_id}~{k}",
                sampling=sampling,
                # P/D: the answer names the first choice's blocks only, so only it holds any;
                # a pulled prompt's KV is the first prompt's
                remote_decode=False, remote_tokens=params.remote_tokens if k < n else 0,
            )  # fmt: skip
            source = choices[k - i] if i else None  # its prompt's first choice
            choices.append(_enqueue_choice(serving, sibling, source, rank))
    except BaseException:
        for stream in choices:
            serving.abort(stream.request_id)
        raise
    return choices[1:]


def _enqueue_choice(
    serving: Serving, params: GenerationParams, source: RequestStream | None, rank: int | None
) -> RequestStream:
    """Queue one choice on ``rank`` (None: the least loaded). A choice after its prompt's first
    (``source``) forks from it, so it goes to the same rank, unless that rank is full and the
    client named none: it then runs alone on another (a fork is only ever an optimisation)."""
    if source is None:
        return serving.enqueue(serving.prepare(params), rank)
    if rank is None and len(serving.engines) > 1:
        home = serving.ranks.rank_of(source.request_id)
        if home is None or not serving.has_room(home):  # (None: its source has ended)
            return serving.enqueue(serving.prepare(params), None)
        rank = home
    return serving.enqueue(serving.prepare(params, fork_of=source.fork_source()), rank)


async def texts(run: Run, serving: Serving, choice: Choice) -> AsyncIterator[Piece]:
    """``choice``'s pieces (each with text or tokens; the last one has the finish reason). The
    engine ends a request at the step whose tokens complete a stop string; here the text is cut
    right before it. With log probabilities, a piece's tokens are those whose text it shows (the
    stop string's tokens are dropped). A failed model call raises ``ModelFailed``."""
    decoder = serving.tokenizer.stream_decoder()
    matcher = choice.matcher
    aligned = None if run.top is None else AlignedTokens(decoder)
    async for delta in choice.stream:
        if aligned is None:
            text = matcher.feed_tokens(decoder, delta.tokens)
            tokens, entries = delta.tokens, delta.logprobs
        else:
            text = aligned.take(matcher, delta.tokens, delta.logprobs)
            tokens, entries = aligned.release()
        if matcher.hit:
            piece = Piece(text, FinishReason.STOP.value, tokens, entries, choice.index,
                          matcher.matched)  # fmt: skip
            yield _seen(choice, piece)
            return
        if delta.finish_reason is FinishReason.ERROR:
            raise ModelFailed(generation_failed(choice.stream.view.error, run.grammar_param))
        if delta.finish_reason is not None:
            rest = matcher.feed(decoder.flush()) + matcher.flush()
            if aligned is not None:
                aligned.shown(rest)
                more, more_entries = aligned.release(everything=True)
                tokens, entries = tokens + more, (entries or []) + more_entries
            reason = delta.finish_reason.value
            last = choice.stream.view.stop_token
            stop = last if last in run.stop_ids else None
            yield _seen(choice, Piece(text + rest, reason, tokens, entries, choice.index, stop))
            return
        if text or tokens:
            yield _seen(choice, Piece(text, None, tokens, entries, choice.index))


def _seen(choice: Choice, piece: Piece) -> Piece:
    """Record ``piece`` in its choice's totals."""
    choice.texts.append(piece.text)
    if choice.logprobs is not None:
        choice.tokens += piece.tokens
        choice.logprobs += piece.logprobs or [None] * len(piece.tokens)
    if piece.reason is not None:
        choice.reason, choice.stop = piece.reason, piece.stop
    return piece


def all_texts(run: Run, serving: Serving) -> AsyncIterator[Piece]:
    """Every choice's pieces, as they come (one choice: its pieces directly)."""
    if len(run.choices) == 1:
        return texts(run, serving, run.choices[0])
    return _merged(run, serving)


async def _merged(run: Run, serving: Serving) -> AsyncIterator[Piece]:
    queue: asyncio.Queue[Piece | Exception | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for piece in texts(run, serving, choice):
                queue.put_nowait(piece)
        except Exception as err:
            queue.put_nowait(err)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(choice)) for choice in run.choices]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def collect(run: Run, serving: Serving) -> list[Outcome]:
    """Every choice's outcome, its tool calls read from the whole reply; ``ModelFailed`` (the
    other choices aborted) if a model call failed."""
    try:
        async for _ in all_texts(run, serving):
            pass
    except ModelFailed:
        run.abort(serving)
        raise
    outcomes = [choice.outcome(run.plan) for choice in run.choices]
    if run.plan is not None:  # each reply was read for tool calls
        for outcome in outcomes:
            serving.metrics.tool_parse(False, bool(outcome.calls), run.request_type)
    return outcomes


async def whole_reply(request: Request, run: Run, serving: Serving) -> list[Outcome]:
    """``collect``, for a reply sent whole: a client that leaves first aborts the request
    (``ClientGone``); a failed choice raises its answer (the ``APIError`` of ``ModelFailed``)."""
    try:
        return await until_disconnected(request, collect(run, serving), lambda: run.abort(serving))
    except ModelFailed as err:
        raise err.error from err


class EventShaper(ABC):
    """A protocol's streamed events, as encoded SSE bytes."""

    def opening(self) -> Iterable[bytes]:
        """Before any text (the protocol's start events; none by default)."""
        return ()

    @abstractmethod
    def pieces(self, piece: Piece, parts: list[Part]) -> Iterable[bytes]:
        """One piece of a choice; ``parts``: its text and tool-call parts (without tools: its
        text, if any)."""

    @abstractmethod
    def ending(self, outcomes: list[Outcome]) -> Iterable[bytes]:
        """After every choice's last piece: the protocol's end events."""

    @abstractmethod
    def failure(self, error: APIError) -> Iterable[bytes]:
        """The request ended in error mid-stream (``ModelFailed.error``: a failed model call, or
        the grammar engine giving up on its grammar): the protocol's error event(s), the
        stream's last."""

    def closed(self) -> None:
        """The stream is over, however it ended (the client may have left midway)."""
        return None


class PartShaper(EventShaper):
    """``pieces`` and ``ending`` of an ``EventShaper`` for a one-choice protocol laid out part
    by part: a subclass gives ``opening`` and ``failure``, then ``text`` (one non-empty
    delta), ``call_start`` (a call's id and name; its arguments follow), ``call_arguments`` (a
    piece of its JSON arguments) and ``closing`` (the end events, after the last text)."""

    @abstractmethod
    def text(self, delta: str) -> Iterable[bytes]: ...
    @abstractmethod
    def call_start(self, index: int, call: ToolCall) -> Iterable[bytes]: ...
    @abstractmethod
    def call_arguments(self, index: int, delta: str) -> Iterable[bytes]: ...
    @abstractmethod
    def closing(self, outcome: Outcome) -> Iterable[bytes]: ...

    def pieces(self, piece: Piece, parts: list[Part]) -> Iterable[bytes]:
        for part in parts:
            if isinstance(part, TextPiece):
                yield from self.text(part.text)
            elif isinstance(part, CallStart):
                yield from self.call_start(part.index, part.call)
            else:
                yield from self.call_arguments(part.index, part.text)

    def ending(self, outcomes: list[Outcome]) -> Iterable[bytes]:
        return self.closing(outcomes[0])


def parts(run: Run, serving: Serving, piece: Piece) -> list[Part]:
    """``piece``'s text and tool-call parts (read by its choice's ``CallReader``: each read
    counted, as vLLM counts each delta its tool parser reads)."""
    reader = run.choices[piece.index].reader
    if reader is None:
        return [TextPiece(piece.text)] if piece.text else []
    found = reader.feed(piece.text, piece.reason)
    called = any(not isinstance(part, TextPiece) for part in found)
    serving.metrics.tool_parse(True, called, run.request_type)
    return found


async def events(run: Run, serving: Serving, shaper: EventShaper) -> AsyncIterator[bytes]:
    """The SSE bytes of ``run`` laid out by ``shaper`` (tool calls read as they stream)."""
    try:
        for event in shaper.opening():
            yield event
        try:
            async for piece in all_texts(run, serving):
                for event in shaper.pieces(piece, parts(run, serving, piece)):
                    yield event
        except ModelFailed as err:
            run.abort(serving)
            for event in shaper.failure(err.error):
                yield event
            return
        for event in shaper.ending([choice.outcome(run.plan) for choice in run.choices]):
            yield event
    finally:
        shaper.closed()


def stream_response(run: Run, serving: Serving, shaper: EventShaper) -> Response:
    """``run`` streamed as SSE: the watchdog cuts off a stalled reader and every choice is
    aborted however the response ends early."""
    settings = serving.settings
    return EventStream(
        events(run, serving, shaper),
        stall_timeout=settings.send_timeout,
        ping=settings.sse_ping_seconds,
        on_close=lambda: run.abort(serving),
    )


PRIORITY_IGNORED = "x-slotserve-priority-ignored"


def flag_priority(response: Response, serving: Serving, internal: InternalRequest) -> Response:
    """Mark a response whose request asked for a priority the policy ignores (any policy but
    ``priority``, header ``x-slotserve-priority-ignored``), so it is not silently dropped."""
    if serving.priority_ignored(internal.priority):
        response.headers[PRIORITY_IGNORED] = "1"
    return response
