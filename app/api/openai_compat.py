"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api import faults, reply_bounds
from app.api.aligned_tokens import AlignedTokens
from app.api.deps import KeyNameDep, ServingDep, data_parallel_rank
from app.api.errors import APIError, generation_failed, model_not_found
from app.api.logprobs import CompletionLogprobs, TokenText, chat_content, prompt_logprobs
from app.api.native import ERROR_RESPONSES, flag_ignored_priority
from app.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIParams
from app.api.streaming import sse_event, sse_response, until_disconnected
from app.api.structured import requested_constraint
from app.api.tools import ToolDeltas, ToolPlan, chat_prompt, tool_plan, whole_message
from app.engine.stop_strings import StopStringMatcher
from app.engine.stream import RequestStream
from app.engine.types import FinishReason
from app.models.protocol import Logprobs
from app.serving import GenerationParams, Serving
from app.structured.constraint import Constraint
from app.version import version

router = APIRouter(prefix="/v1", tags=["openai"])
DONE = b"data: [DONE]\n\n"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
GREEDY_BELOW = 1e-5  # a temperature below it samples greedily (vLLM's threshold)
FINGERPRINT = f"slotserve-{version()}"  # system_fingerprint: the server and its version


@router.get("/models")
async def list_models(serving: ServingDep) -> dict[str, Any]:
    created, name = int(serving.started_at), serving.settings.model_name
    model = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "slotserve",
        "root": name,  # vLLM's: the model's path, which we keep to ourselves (as an adapter's)
        "parent": None,
        "max_model_len": serving.settings.max_model_len,
        "permission": [_permission(created)],  # vLLM's field, from OpenAI's former API
        "profile": serving.settings.profile,  # the GPU the step clock imitates (null: none)
    }
    # an adapter's root is its name: vLLM shows its local path there, which tells any caller
    # where the server keeps files
    adapters = [
        {"id": a.name, "object": "model", "created": int(serving.started_at),
         "owned_by": "slotserve", "root": a.name, "parent": a.parent}
        for a in serving.loras.adapters.values()
    ]  # fmt: skip
    return {"object": "list", "data": [model, *adapters]}


def _permission(created: int) -> dict[str, Any]:
    """The one ``permission`` entry vLLM lists per model: sampling and logprobs allowed."""
    return {"id": f"modelperm-{created:x}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}  # fmt: skip


@router.post("/completions", responses=ERROR_RESPONSES)
async def completions(
    body: CompletionRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    prompts = completion_prompts(body, serving)
    max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
    constraint = requested_constraint(body.response_format, body.structured_outputs)
    await serving.precompile(*constraint)
    run = _start(request, serving, body, prompts, max_tokens, "cmpl", key_name, constraint)
    shape = CompletionShape(run.id, body.model or serving.settings.model_name, run, bool(body.echo))
    response = await _respond(run, body, request, serving, shape)
    return flag_ignored_priority(response, serving, body.priority)


@router.post("/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    plan = tool_plan(body, serving)
    ids = chat_prompt(body.messages, plan, serving)
    constraint = _tool_constraint(body, plan)
    # max_completion_tokens replaces the deprecated max_tokens; it wins when both are set
    max_tokens = (
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    )
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                       code="invalid_value")  # fmt: skip
    if constraint is None:
        constraint = requested_constraint(body.response_format, body.structured_outputs)
    await serving.precompile(*constraint)
    run = _start(request, serving, body, [ids], max_tokens, "chatcmpl", key_name, constraint)
    name = body.model or serving.settings.model_name
    shape = ChatShape(run.id, name, run) if plan is None else ToolChatShape(run.id, name, run, plan)
    response = await _respond(run, body, request, serving, shape)
    return flag_ignored_priority(response, serving, body.priority)


def _tool_constraint(
    body: ChatCompletionRequest, plan: ToolPlan | None
) -> tuple[Constraint | None, str] | None:
    """The grammar of a ``required`` or named tool choice, which ``response_format`` and
    ``structured_outputs`` cannot be combined with (None: the request's own, if any)."""
    constraint = plan.constraint() if plan is not None else None
    if constraint is None:
        return None
    for field in ("response_format", "structured_outputs"):
        value = getattr(body, field)
        if value is not None and getattr(value, "type", None) != "text":
            raise APIError(400, f"{field} cannot be combined with a tool_choice that forces a "
                           "tool call", param=field, code="invalid_request")  # fmt: skip
    return constraint, "tools"


def completion_prompts(body: CompletionRequest, serving: Serving) -> list[list[int]]:
    """A completion's prompts (text, token ids, or a list of either) as token id lists."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [serving.tokenizer.encode(prompt)]
    if all(isinstance(token, int) for token in prompt):
        return [[token for token in prompt if isinstance(token, int)]]
    return [
        serving.tokenizer.encode(item) if isinstance(item, str) else list(item)
        for item in prompt
        if isinstance(item, (str, list))
    ]


@dataclass
class Run:
    """One OpenAI request in flight: one engine stream and stop-string matcher per choice
    (choice ``k`` answers prompt ``k // n``), and its text post-processing."""

    id: str
    streams: list[RequestStream]
    matchers: list[StopStringMatcher]
    created: int
    text: TokenText  # each token's text (log probabilities)
    top: int | None = None  # alternatives per token when log probabilities were asked for
    n: int = 1  # choices per prompt
    grammar_param: str | None = None  # the field that set the request's grammar, if one did

    @property
    def stream(self) -> RequestStream:
        """Choice 0's stream (the prompt's facts when there is one prompt)."""
        return self.streams[0]

    def abort(self, serving: Serving) -> None:
        """End every choice still running (client gone)."""
        for stream in self.streams:
            if stream.seq.finish_reason is None:
                serving.abort(stream.request_id)


@dataclass
class Piece:
    """A part of the reply: its text, the tokens it came from (with their log probabilities,
    when asked for) and, on the last one, the finish reason."""

    text: str
    reason: str | None
    tokens: list[int]
    logprobs: list[Logprobs | None] | None = None
    index: int = 0  # the choice it belongs to (n > 1)
    stop: str | None = None  # the stop string that ended the choice (vLLM's stop_reason)


def _start(
    request: Request,
    serving: Serving,
    body: OpenAIParams,
    prompts: list[list[int]],
    max_tokens: int | None,
    prefix: str,
    key_name: str | None,
    constraint: tuple[Constraint | None, str] | None = None,
) -> Run:
    rank = data_parallel_rank(request, serving)
    try:
        lora = serving.adapter(body.model)  # the base model, a LoRA adapter, or 404
    except LookupError:
        raise model_not_found(str(body.model), serving.settings.model_name) from None
    unsupported = body.unsupported()
    if unsupported is not None:
        raise APIError(400, f"{unsupported} is not supported by this server; leave it "
                       "unset (functions/function_call: use tools/tool_choice; guided_*: use "
                       "structured_outputs)",
                       param=unsupported, code="unsupported_parameter")  # fmt: skip
    _as_vllm_refuses(body, max_tokens)
    stops = [] if constraint is not None and constraint[1] == "tools" else body.stop_strings()
    if constraint is None:
        constraint = requested_constraint(body.response_format, body.structured_outputs)
    grammar, grammar_param = constraint
    params = GenerationParams(
        prompt=prompts[0], max_tokens=max_tokens, stop_token_ids=body.stop_token_ids,
        stop_strings=stops, ignore_eos=body.ignore_eos, priority=body.priority,
        sampling=body.sampling(), bad_words=body.bad_words or [],
        user=key_name if key_name is not None else body.user, key_name=key_name,
        constraint=grammar, constraint_param=grammar_param, lora=lora,
    )  # fmt: skip
    n = _choices(body, serving, len(prompts), rank)
    reply_bounds.check(serving, [len(p) for p in prompts], max_tokens, _logprob_ask(body, n))
    stream = faults.submit(request, serving, params, streaming=bool(body.stream),
                           id_prefix=prefix, model=body.model, rank=rank)  # fmt: skip
    streams = [stream, *_fan_out(serving, params, stream, prompts, n, rank)]
    matchers = [StopStringMatcher(stops, params.sampling.min_tokens) for _ in streams]
    text = TokenText(serving.tokenizer)
    top = body.top_logprobs_asked()
    return Run(stream.request_id, streams, matchers, int(time.time()), text, top, n,
               grammar_param if grammar is not None else None)  # fmt: skip


def _as_vllm_refuses(body: OpenAIParams, max_tokens: int | None) -> None:
    """The requests vLLM answers with a 400 that this server could serve: refused alike, since
    it stands in for vLLM (a client tested against it meets the same answers)."""
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    if max_tokens is not None and max_tokens < 1 and not echo:  # echo alone scores a prompt
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}",
                       param="max_tokens", code="invalid_value")  # fmt: skip
    if (body.n or 1) > 1 and body.temperature is not None and body.temperature < GREEDY_BELOW:
        raise APIError(400, f"n must be 1 when using greedy sampling, got {body.n}", param="n",
                       code="invalid_value")  # fmt: skip
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true",
                       param="stream_options", code="invalid_value")  # fmt: skip


def _choices(body: OpenAIParams, serving: Serving, prompts: int, rank: int | None) -> int:
    """``n`` checked against ``--max-n`` (``best_of`` may only repeat it), and the request's
    ``prompts * n`` engine requests against what its ranks can ever hold (slots + waiting
    bound): past it a retry could never succeed, so it is a 400, not a 429."""
    n = body.n or 1
    if n > serving.settings.max_n:
        raise APIError(400, f"n ({n}) exceeds this server's --max-n ({serving.settings.max_n})",
                       param="n", code="invalid_value")  # fmt: skip
    if body.best_of is not None and body.best_of != n:
        raise APIError(400, "best_of must equal n (no server-side ranking of choices)",
                       param="best_of", code="unsupported_parameter")  # fmt: skip
    settings = serving.settings
    ranks = 1 if rank is not None else settings.data_parallel_size
    room = ranks * (settings.num_slots + settings.max_waiting)
    if prompts * n > room:
        raise APIError(400, f"{prompts} prompt(s) x n={n} = {prompts * n} sequences exceed what "
                       f"this server can ever hold at once ({room}: slots + --max-waiting)",
                       param="n", code="invalid_value")  # fmt: skip
    return n


def _logprob_ask(body: OpenAIParams, n: int) -> reply_bounds.LogprobAsk:
    """The log probabilities ``body`` asks for, as its route renders them: completions repeat
    the prompt's in every choice (twice with ``echo``: in ``logprobs`` and in
    ``prompt_logprobs``), chat shows the prompt's once, next to the choices."""
    top, prompt = body.top_logprobs_asked(), body.prompt_logprobs
    if isinstance(body, CompletionRequest):
        echo = bool(body.echo) and top is not None
        fields = ("logprobs", "n", "max_tokens", "echo", "prompt_logprobs")
        return reply_bounds.LogprobAsk(n, top, prompt, fields, echo=echo)
    chat = ("top_logprobs", "n", "max_completion_tokens", "prompt_logprobs")
    return reply_bounds.LogprobAsk(n, top, prompt, chat, prompt_once=True)


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
    if len(prompts) * n == 1 or first.seq.finish_reason is not None:  # (an injected failure)
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
        home = serving.rank_of(source.request_id)
        if home is None or not serving.has_room(home):  # (None: its source has ended)
            return serving.enqueue(serving.prepare(params), None)
        rank = home
    return serving.enqueue(serving.prepare(params, fork_of=source.seq), rank)


async def _texts(run: Run, serving: Serving, index: int = 0) -> AsyncIterator[Piece]:
    """Choice ``index``'s pieces. The engine ends a request at the step whose tokens complete a
    stop string; here the text is cut right before it. With log probabilities, a piece's tokens
    are those whose text it shows (``AlignedTokens``: the stop string's tokens are dropped)."""
    decoder = serving.tokenizer.stream_decoder()
    stream, matcher = run.streams[index], run.matchers[index]
    aligned = None if run.top is None else AlignedTokens(decoder)
    async for delta in stream:
        if aligned is None:
            text = matcher.feed_tokens(decoder, delta.tokens)
            tokens, entries = delta.tokens, delta.logprobs
        else:
            text = aligned.take(matcher, delta.tokens, delta.logprobs)
            tokens, entries = aligned.release()
        if matcher.hit:
            yield Piece(text, FinishReason.STOP.value, tokens, entries, index, matcher.matched)
            return
        if delta.finish_reason is FinishReason.ERROR:
            raise _ModelFailed(generation_failed(stream.seq.error, run.grammar_param))
        if delta.finish_reason is not None:
            rest = matcher.feed(decoder.flush()) + matcher.flush()
            if aligned is not None:
                aligned.shown(rest)
                more, more_entries = aligned.release(everything=True)
                tokens, entries = tokens + more, (entries or []) + more_entries
            yield Piece(text + rest, delta.finish_reason.value, tokens, entries, index)
            return
        if text or (tokens and aligned is not None):
            yield Piece(text, None, tokens, entries, index)


async def _all_texts(run: Run, serving: Serving) -> AsyncIterator[Piece]:
    """Every choice's pieces, as they come (one choice: its pieces directly)."""
    if len(run.streams) == 1:
        async for piece in _texts(run, serving):
            yield piece
        return
    queue: asyncio.Queue[Piece | Exception | None] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for piece in _texts(run, serving, index):
                queue.put_nowait(piece)
        except Exception as err:
            queue.put_nowait(err)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(run.streams))]
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


class _ModelFailed(Exception):
    """A choice ended in error: ``error`` is the answer (500 ``model_error``, or 400
    ``invalid_grammar`` when the grammar engine gave up on the request's grammar)."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


def _usage(run: Run) -> dict[str, int]:
    """Each prompt once, every choice's generated tokens."""
    prompt = sum(stream.seq.prompt_len for stream in run.streams[:: run.n])
    generated = sum(stream.seq.num_generated for stream in run.streams)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


async def _respond(
    run: Run, body: OpenAIParams, request: Request, serving: Serving, shape: Shape
) -> Response:
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        shape.usage_last = usage
        chunks = _stream_chunks(run, serving, shape, usage)
        return sse_response(chunks, run.streams, serving)
    abort = lambda: run.abort(serving)  # noqa: E731
    wholes = await until_disconnected(request, _collect(run, serving), abort)
    fields = "n, max_tokens, logprobs, echo or prompt_logprobs"
    return reply_bounds.json_reply(shape.whole(wholes, _usage(run), run.created), serving, fields)


async def _collect(run: Run, serving: Serving) -> list[Piece]:
    """The whole reply: one piece per choice."""
    wholes = [
        Piece("", None, [], [] if run.top is not None else None, i) for i in range(len(run.streams))
    ]
    try:
        async for piece in _all_texts(run, serving):
            whole = wholes[piece.index]
            whole.text += piece.text
            whole.reason, whole.stop = piece.reason, piece.stop
            whole.tokens += piece.tokens
            if whole.logprobs is not None:
                whole.logprobs += piece.logprobs or [None] * len(piece.tokens)
    except _ModelFailed as err:
        run.abort(serving)
        raise err.error from err
    return wholes


async def _stream_chunks(
    run: Run, serving: Serving, shape: Shape, include_usage: bool
) -> AsyncIterator[bytes]:
    for first in shape.opening(run.created):
        yield sse_event(None, first)
    try:
        async for piece in _all_texts(run, serving):
            for chunk in shape.chunks(piece, run.created):
                yield sse_event(None, chunk)
    except _ModelFailed as err:
        run.abort(serving)
        yield sse_event(None, err.error.body())
        return
    if include_usage:
        yield sse_event(None, shape.usage_chunk(_usage(run), run.created))
    yield DONE


class Shape:
    """How one route lays out its response objects. ``system_fingerprint`` (vLLM's, naming the
    server's version) is on a whole reply, and in a stream on the last chunk: the usage chunk
    when one is asked for (``usage_last``), else the chunk that ends a choice."""

    object_whole = ""
    object_chunk = ""
    usage_last = False

    def __init__(self, request_id: str, model: str, run: Run) -> None:
        self.id, self.model, self.run = request_id, model, run

    def envelope(self, obj: str, created: int, choices: list[Any]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": created, "model": self.model,
                "choices": choices}  # fmt: skip

    def opening(self, created: int) -> list[dict[str, Any]]:
        return []

    def whole(self, pieces: list[Piece], usage: dict[str, int], created: int) -> dict[str, Any]:
        choices = [self.choice(piece) for piece in pieces]
        return self.envelope(self.object_whole, created, choices) | {
            "system_fingerprint": FINGERPRINT, "usage": usage}  # fmt: skip

    def chunk(self, piece: Piece, created: int) -> dict[str, Any]:
        out = self.envelope(self.object_chunk, created, [self.delta(piece)])
        if piece.reason is not None and not self.usage_last:
            out["system_fingerprint"] = FINGERPRINT
        return out

    def chunks(self, piece: Piece, created: int) -> list[dict[str, Any]]:
        """The stream chunks for one piece of the reply."""
        return [self.chunk(piece, created)]

    def usage_chunk(self, usage: dict[str, int], created: int) -> dict[str, Any]:
        return self.envelope(self.object_chunk, created, []) | {
            "usage": usage, "system_fingerprint": FINGERPRINT}  # fmt: skip

    choice: Callable[..., dict[str, Any]]
    delta: Callable[..., dict[str, Any]]


class CompletionShape(Shape):
    """A completion; with ``echo``, the prompt (and its log probabilities) comes first: in the
    whole reply, or in the first streamed chunk."""

    object_whole = object_chunk = "text_completion"

    def __init__(self, request_id: str, model: str, run: Run, echo: bool) -> None:
        super().__init__(request_id, model, run)
        self.echo = echo
        self.started: set[int] = set()  # choices whose first piece was rendered
        self.logprobs = [
            None if run.top is None else CompletionLogprobs(run.text, run.top) for _ in run.streams
        ]

    def choice(self, piece: Piece) -> dict[str, Any]:
        index = piece.index
        seq = self.run.streams[index].seq  # its prompt: prompt index // n
        first = index not in self.started
        self.started.add(index)
        if self.echo and first:
            prompt = seq.prompt
            prompt_entries = seq.prompt_logprobs or [None] * len(prompt)
            logprobs = None if piece.logprobs is None else [*prompt_entries, *piece.logprobs]
            text = self.run.text.decode(prompt)
            tokens = [*prompt, *piece.tokens]
            piece = dataclasses.replace(piece, text=text + piece.text, tokens=tokens,
                                        logprobs=logprobs)  # fmt: skip
        rendered, renderer = None, self.logprobs[index]
        if renderer is not None:
            entries = piece.logprobs or [None] * len(piece.tokens)
            rendered = renderer.render(piece.tokens, entries)
        out = {"index": index, "text": piece.text, "finish_reason": piece.reason,
               "stop_reason": piece.stop, "logprobs": rendered}  # fmt: skip
        if first and seq.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs(seq.prompt, seq.prompt_logprobs, self.run.text)
        return out

    delta = choice


class ChatShape(Shape):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def opening(self, created: int) -> list[dict[str, Any]]:
        return [
            self.envelope(self.object_chunk, created, [
                {"index": i, "delta": {"role": "assistant", "content": ""},
                 "finish_reason": None, "logprobs": None}
            ])
            for i in range(len(self.run.streams))
        ]  # fmt: skip

    def choice(self, piece: Piece) -> dict[str, Any]:
        message = {"role": "assistant", "content": piece.text}
        return {"index": piece.index, "message": message, "finish_reason": piece.reason,
                "stop_reason": piece.stop, "logprobs": self._logprobs(piece)}  # fmt: skip

    def delta(self, piece: Piece) -> dict[str, Any]:
        content = {"content": piece.text} if piece.text else {}
        out = {"index": piece.index, "delta": content, "finish_reason": piece.reason,
               "logprobs": self._logprobs(piece)}  # fmt: skip
        if piece.stop is not None:  # vLLM's, on the chunk a stop string ends
            out["stop_reason"] = piece.stop
        return out

    def whole(self, pieces: list[Piece], usage: dict[str, int], created: int) -> dict[str, Any]:
        out = super().whole(pieces, usage, created)
        seq = self.run.stream.seq
        if seq.prompt_logprobs is not None:  # vLLM's field, next to the choices
            out["prompt_logprobs"] = prompt_logprobs(seq.prompt, seq.prompt_logprobs, self.run.text)
        return out

    def _logprobs(self, piece: Piece) -> dict[str, Any] | None:
        if self.run.top is None:
            return None
        entries = piece.logprobs or [None] * len(piece.tokens)
        return {"content": chat_content(piece.tokens, entries, self.run.text, self.run.top),
                "refusal": None}  # fmt: skip


class ToolChatShape(ChatShape):
    """A chat reply that may call tools (app/api/tools.py): ``message.tool_calls`` and
    ``finish_reason: "tool_calls"``, streamed as OpenAI streams calls (per choice)."""

    def __init__(self, request_id: str, model: str, run: Run, plan: ToolPlan) -> None:
        super().__init__(request_id, model, run)
        self.plan = plan
        self.deltas = [ToolDeltas(plan) for _ in run.streams]

    def choice(self, piece: Piece) -> dict[str, Any]:
        message, reason = whole_message(piece.text, piece.reason, self.plan)
        return {"index": piece.index, "message": message, "finish_reason": reason,
                "stop_reason": piece.stop, "logprobs": self._logprobs(piece)}  # fmt: skip

    def chunks(self, piece: Piece, created: int) -> list[dict[str, Any]]:
        logprobs = self._logprobs(piece)
        out = []
        for delta, end in self.deltas[piece.index].feed(piece.text, piece.reason):
            choice = {"index": piece.index, "delta": delta, "finish_reason": end,
                      "logprobs": logprobs}  # fmt: skip
            logprobs = None  # once per piece
            chunk = self.envelope(self.object_chunk, created, [choice])
            if end is not None and not self.usage_last:
                chunk["system_fingerprint"] = FINGERPRINT
            out.append(chunk)
        return out
