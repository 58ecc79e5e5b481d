"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api import generation, kv_transfer, reply_bounds
from app.api.deps import KeyNameDep, ServingDep
from app.api.errors import ERROR_RESPONSES, APIError, InvalidField
from app.api.generation import InternalRequest, Outcome, Piece, Run
from app.api.logprobs import CompletionLogprobs, TokenText, chat_content, prompt_logprobs
from app.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIParams
from app.api.streaming import sse_event
from app.api.structured import requested_constraint
from app.api.tool_reader import CallArguments, CallStart, Part, TextPiece
from app.api.tools import (
    ARGUMENT_FRAGMENT,
    ToolPlan,
    call_json,
    chat_prompt,
    forced_constraint,
    formats_set,
    tool_plan,
)
from app.serving import Serving
from app.structured.constraint import Constraint
from app.structured.tools import ToolMode
from app.version import version

router = APIRouter(prefix="/v1", tags=["openai"])
DONE = b"data: [DONE]\n\n"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
GREEDY_BELOW = 1e-5  # a temperature below it samples greedily (vLLM's threshold)
FINGERPRINT = f"slotserve-{version()}"  # system_fingerprint: the server and its version


@router.get("/models")
async def list_models(serving: ServingDep) -> dict[str, Any]:
    created, name = int(serving.started_at), serving.settings.model_name

    def card(model: str, parent: str | None) -> dict[str, Any]:
        # ``root`` is the name: vLLM shows the model's (or an adapter's) local path there, which
        # tells any caller where the server keeps files
        return {"id": model, "object": "model", "created": created, "owned_by": "slotserve",
                "root": model, "parent": parent}  # fmt: skip

    model = card(name, None) | {
        "max_model_len": serving.settings.max_model_len,
        "permission": [_permission(created)],  # vLLM's field, from OpenAI's former API
        "profile": serving.settings.profile,  # the GPU the step clock imitates (null: none)
    }
    adapters = [card(a.name, a.parent) for a in serving.loras.adapters.values()]
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
    return await _serve(completion_request(body, serving), body, request, serving, key_name)


@router.post("/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    return await _serve(chat_request(body, serving), body, request, serving, key_name)


async def _serve(
    internal: InternalRequest,
    body: OpenAIParams,
    request: Request,
    serving: Serving,
    key_name: str | None,
) -> Response:
    """``internal`` (``body`` in the engine's terms) run and answered, whole or streamed, in
    its route's layout: a completion's, a chat's, or a chat's that may call tools."""
    await serving.precompile(internal.constraint, internal.constraint_param)
    note = await _transfer(body, request, serving, internal)
    run = generation.start(request, serving, internal, key_name)
    shape: type[Shape] = ChatShape if internal.tools is None else ToolChatShape
    if isinstance(body, CompletionRequest):
        shape = CompletionShape
    layout = shape(run, body, serving)
    if body.stream:
        response = generation.stream_response(run, serving, layout)
    else:
        outcomes = await generation.whole_reply(request, run, serving)
        fields = "n, max_tokens, logprobs, echo or prompt_logprobs"
        response = reply_bounds.json_reply(layout.whole(outcomes), serving, fields)
    return kv_transfer.mark(generation.flag_priority(response, serving, internal), note)


def completion_request(body: CompletionRequest, serving: Serving) -> InternalRequest:
    """A completion's body in the engine's terms, checked as ``/v1/completions`` checks it (its
    render, ``app/api/render.py``, reads it the same way)."""
    prompts = completion_prompts(body, serving)
    max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
    constraint = requested_constraint(body.response_format, body.structured_outputs)
    return _internal(body, serving, prompts, max_tokens, "cmpl", constraint)


def chat_request(
    body: ChatCompletionRequest, serving: Serving, decide: bool = True
) -> InternalRequest:
    """A chat's body in the engine's terms (its prompt through the chat template), checked as
    ``/v1/chat/completions`` checks it. ``decide``: let a mock decide now whether it calls a
    tool under ``auto`` (False for a render, which only describes the request)."""
    plan = tool_plan(body, serving, decide=decide)
    ids = chat_prompt(body.messages, plan, serving)
    constraint = forced_constraint(plan, formats_set(body))
    # max_completion_tokens replaces the deprecated max_tokens; it wins when both are set
    max_tokens = (
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    )
    if body.top_logprobs and not body.logprobs:
        raise InvalidField("top_logprobs needs logprobs: true", param="top_logprobs",
                           code="invalid_value")  # fmt: skip
    if constraint is None:
        constraint = requested_constraint(body.response_format, body.structured_outputs)
    return _internal(body, serving, [ids], max_tokens, "chatcmpl", constraint, plan)


async def _transfer(
    body: OpenAIParams, request: Request, serving: Serving, internal: InternalRequest
) -> str:
    """The body's ``kv_transfer_params`` (prefill/decode disaggregation) applied to
    ``internal``: a producer's request holds its blocks; a consumer's pulls them first (the
    ``x-kv-transfer`` header's value, "" for any other request)."""
    want = kv_transfer.intent(serving, body.kv_transfer_params)
    if want is None:
        return ""
    # a streamed answer cannot say where the blocks are: only a whole one holds them
    internal.remote_decode = want.remote_decode and not internal.stream
    internal.remote_tokens, note = await kv_transfer.receive(
        request, serving, want, len(internal.prompt)
    )
    return note


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


def _internal(
    body: OpenAIParams,
    serving: Serving,
    prompts: list[list[int]],
    max_tokens: int | None,
    prefix: str,
    constraint: tuple[Constraint | None, str],
    plan: ToolPlan | None = None,
) -> InternalRequest:
    """The body in the engine's terms, checked: the model it names (404), the fields this server
    cannot honour, ``n`` and the reply's log-probability bounds (400)."""
    generation.adapter(serving, body.model)
    unsupported = body.unsupported()
    if unsupported is not None:
        raise InvalidField(f"{unsupported} is not supported by this server; leave it "
                           "unset (functions/function_call: use tools/tool_choice; guided_*: use "
                           "structured_outputs)",
                           param=unsupported, code="unsupported_parameter")  # fmt: skip
    _as_vllm_refuses(body, max_tokens)
    n = _choices(body, serving)
    reply_bounds.check(serving, [len(p) for p in prompts], max_tokens, _logprob_ask(body, n))
    grammar, param = constraint
    return InternalRequest(
        prompt=prompts[0], more_prompts=prompts[1:], n=n, max_tokens=max_tokens,
        stop_token_ids=body.stop_token_ids, bad_words=body.bad_words or [],
        stop_strings=[] if param == "tools" else body.stop_strings(),
        ignore_eos=body.ignore_eos, priority=body.priority, sampling=body.sampling(),
        user=body.user, model=body.model, stream=bool(body.stream), id_prefix=prefix,
        constraint=grammar, constraint_param=param, tools=plan,
    )  # fmt: skip


def _as_vllm_refuses(body: OpenAIParams, max_tokens: int | None) -> None:
    """The requests vLLM answers with a 400 that this server could serve: refused alike, since
    it stands in for vLLM (a client tested against it meets the same answers)."""
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    if max_tokens is not None and max_tokens < 1 and not echo:  # echo alone scores a prompt
        raise InvalidField(f"max_tokens must be at least 1, got {max_tokens}",
                           param="max_tokens", code="invalid_value")  # fmt: skip
    if (body.n or 1) > 1 and body.temperature is not None and body.temperature < GREEDY_BELOW:
        raise InvalidField(f"n must be 1 when using greedy sampling, got {body.n}", param="n",
                           code="invalid_value")  # fmt: skip
    if body.stream_options is not None and not body.stream:
        raise InvalidField("stream_options can only be set when stream is true",
                           param="stream_options", code="invalid_value")  # fmt: skip


def _choices(body: OpenAIParams, serving: Serving) -> int:
    """``n`` checked against ``--max-n`` (``best_of`` may only repeat it)."""
    n = body.n or 1
    if n > serving.settings.max_n:
        raise InvalidField(f"n ({n}) exceeds this server's --max-n ({serving.settings.max_n})",
                           param="n", code="invalid_value")  # fmt: skip
    if body.best_of is not None and body.best_of != n:
        raise InvalidField("best_of must equal n (no server-side ranking of choices)",
                           param="best_of", code="unsupported_parameter")  # fmt: skip
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


class Shape(generation.EventShaper):
    """How one route lays out its response objects: the whole reply, or its stream (an
    ``EventShaper``: chunks, the usage chunk when ``stream_options.include_usage`` asks, then
    ``[DONE]``; a failed choice ends the stream with an error object and no ``[DONE]``).
    ``system_fingerprint`` (vLLM's, naming the server's version) is on a whole reply, and in a
    stream on the last chunk: the usage chunk when one is asked for, else the chunk that ends a
    choice."""

    object_whole = ""
    object_chunk = ""

    def __init__(self, run: Run, body: OpenAIParams, serving: Serving) -> None:
        self.run, self.id, self.model, self.created = run, run.id, run.model, run.created
        self.text = TokenText(serving.tokenizer)  # each token's text (log probabilities)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.kv_transfer = serving.kv_transfer

    def envelope(self, obj: str, choices: list[Any]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def usage(self) -> dict[str, int]:
        """Each prompt once, every choice's generated tokens."""
        prompt, generated = self.run.usage()
        return {"prompt_tokens": prompt, "completion_tokens": generated,
                "total_tokens": prompt + generated}  # fmt: skip

    def whole(self, outcomes: list[Outcome]) -> dict[str, Any]:
        choices = [self.choice(outcome) for outcome in outcomes]
        out = self.envelope(self.object_whole, choices) | {
            "system_fingerprint": FINGERPRINT, "usage": self.usage()}  # fmt: skip
        view = self.run.stream.view
        if view.held is not None and self.kv_transfer is not None:  # a P/D producer's prefill
            out["kv_transfer_params"] = self.kv_transfer.answer(view.request_id, view.held)
        return out

    def choice(self, outcome: Outcome) -> dict[str, Any]:
        """A choice of the whole reply: its outcome rendered as one piece."""
        piece = Piece(outcome.text, outcome.finish_reason, outcome.tokens, outcome.logprobs,
                      outcome.index, outcome.stop_sequence)  # fmt: skip
        return self.rendered(piece)

    def chunks(self, piece: Piece, parts: list[Part]) -> list[dict[str, Any]]:
        """The stream chunks for one piece of the reply."""
        if not (piece.text or piece.reason or (piece.tokens and self.run.top is not None)):
            return []
        return [self.chunk([self.delta(piece)], piece.reason)]

    def chunk(self, choices: list[Any], end: str | None) -> dict[str, Any]:
        """A stream chunk; the one that ends a choice names the server when no usage chunk
        comes after it."""
        out = self.envelope(self.object_chunk, choices)
        if end is not None and not self.include_usage:
            out["system_fingerprint"] = FINGERPRINT
        return out

    def pieces(self, piece: Piece, parts: list[Part]) -> Iterable[bytes]:
        return [sse_event(None, chunk) for chunk in self.chunks(piece, parts)]

    def ending(self, outcomes: list[Outcome]) -> Iterable[bytes]:
        if self.include_usage:
            usage = {"usage": self.usage(), "system_fingerprint": FINGERPRINT}
            yield sse_event(None, self.envelope(self.object_chunk, []) | usage)
        yield DONE

    def failure(self, error: APIError) -> Iterable[bytes]:
        return [sse_event(None, error.body())]

    rendered: Callable[..., dict[str, Any]]
    delta: Callable[..., dict[str, Any]]


class CompletionShape(Shape):
    """A completion; with ``echo``, the prompt (and its log probabilities) comes first: in the
    whole reply, or in the first streamed chunk."""

    object_whole = object_chunk = "text_completion"

    def __init__(self, run: Run, body: CompletionRequest, serving: Serving) -> None:
        super().__init__(run, body, serving)
        self.echo = bool(body.echo)
        self.started: set[int] = set()  # choices whose first piece was rendered
        top = run.top
        self.logprobs = [
            None if top is None else CompletionLogprobs(self.text, top) for _ in run.choices
        ]

    def rendered(self, piece: Piece) -> dict[str, Any]:
        index = piece.index
        view = self.run.choices[index].stream.view  # its prompt: prompt index // n
        first = index not in self.started
        self.started.add(index)
        if self.echo and first:
            prompt = view.prompt
            prompt_entries = view.prompt_logprobs or [None] * len(prompt)
            logprobs = None if piece.logprobs is None else [*prompt_entries, *piece.logprobs]
            text = self.text.tokenizer.decode(prompt)
            piece = Piece(text + piece.text, piece.reason, [*prompt, *piece.tokens], logprobs,
                          index, piece.stop)  # fmt: skip
        rendered, renderer = None, self.logprobs[index]
        if renderer is not None:
            entries = piece.logprobs or [None] * len(piece.tokens)
            rendered = renderer.render(piece.tokens, entries)
        out = {"index": index, "text": piece.text, "finish_reason": piece.reason,
               "stop_reason": piece.stop, "logprobs": rendered}  # fmt: skip
        if first and view.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs(view.prompt, view.prompt_logprobs, self.text)
        return out

    def delta(self, piece: Piece) -> dict[str, Any]:
        """A streamed chunk: ``rendered``, and on an echoed choice's first chunk its prompt's
        token ids (``prompt_token_ids``, as vLLM's stream sends them)."""
        echoed = self.echo and piece.index not in self.started
        out = self.rendered(piece)
        if echoed:
            out["prompt_token_ids"] = list(self.run.choices[piece.index].stream.view.prompt)
        return out


class ChatShape(Shape):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def opening(self) -> Iterable[bytes]:
        return [
            sse_event(None, self.envelope(self.object_chunk, [
                {"index": i, "delta": {"role": "assistant", "content": ""},
                 "finish_reason": None, "logprobs": None}
            ]))
            for i in range(len(self.run.choices))
        ]  # fmt: skip

    def rendered(self, piece: Piece) -> dict[str, Any]:
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

    def whole(self, outcomes: list[Outcome]) -> dict[str, Any]:
        out = super().whole(outcomes)
        view = self.run.stream.view
        if view.prompt_logprobs is not None:  # vLLM's field, next to the choices
            out["prompt_logprobs"] = prompt_logprobs(view.prompt, view.prompt_logprobs, self.text)
        return out

    def _logprobs(self, piece: Piece) -> dict[str, Any] | None:
        top = self.run.top
        if top is None:
            return None
        entries = piece.logprobs or [None] * len(piece.tokens)
        return {"content": chat_content(piece.tokens, entries, self.text, top),
                "refusal": None}  # fmt: skip


class ToolChatShape(ChatShape):
    """A chat reply that may call tools: ``message.tool_calls`` and ``finish_reason:
    "tool_calls"`` (``stop`` for a named function, as OpenAI's), streamed as OpenAI streams calls
    (per call an ``index``, an ``id`` and the function's name, then argument fragments)."""

    def __init__(self, run: Run, body: ChatCompletionRequest, serving: Serving) -> None:
        super().__init__(run, body, serving)
        assert run.plan is not None
        self.named = run.plan.choice.mode is ToolMode.NAMED

    def choice(self, outcome: Outcome) -> dict[str, Any]:
        out = super().choice(outcome)
        if outcome.calls:
            listed = [call_json(i, call) for i, call in enumerate(outcome.calls)]
            for entry in listed:
                entry.pop("index")  # a whole message's calls have no index
            out["message"] |= {"content": outcome.text or None, "tool_calls": listed}
            out["finish_reason"] = "stop" if self.named else "tool_calls"
        return out

    def chunks(self, piece: Piece, parts: list[Part]) -> list[dict[str, Any]]:
        deltas: list[tuple[dict[str, Any], str | None]] = [
            (delta, None) for part in parts for delta in self._deltas(part)
        ]
        if piece.reason is not None:
            reader = self.run.choices[piece.index].reader
            called = reader is not None and reader.calls and not self.named
            deltas.append(({}, "tool_calls" if called else piece.reason))
        logprobs = self._logprobs(piece)
        out = []
        for delta, end in deltas:
            choice = {"index": piece.index, "delta": delta, "finish_reason": end,
                      "logprobs": logprobs}  # fmt: skip
            logprobs = None  # once per piece
            out.append(self.chunk([choice], end))
        return out

    def _deltas(self, part: Part) -> list[dict[str, Any]]:
        if isinstance(part, TextPiece):
            return [{"content": part.text}]
        if isinstance(part, CallStart):
            return [{"tool_calls": [call_json(part.index, part.call, False)]}]
        assert isinstance(part, CallArguments)
        text, size = part.text, len(part.text) if self.named else ARGUMENT_FRAGMENT
        return [
            {"tool_calls": [{"index": part.index, "function": {"arguments": text[at : at + size]}}]}
            for at in range(0, len(text), max(size, 1))
        ]
