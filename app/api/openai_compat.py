"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api import faults
from app.api.deps import KeyNameDep, ServingDep, data_parallel_rank
from app.api.errors import APIError, error_body, model_failed_message, model_not_found
from app.api.native import ERROR_RESPONSES, flag_ignored_priority
from app.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIParams
from app.api.streaming import sse_event, sse_response, until_disconnected
from app.engine.stop_strings import StopStringMatcher
from app.engine.stream import RequestStream
from app.engine.types import FinishReason
from app.serving import GenerationParams, Serving

router = APIRouter(prefix="/v1", tags=["openai"])
DONE = b"data: [DONE]\n\n"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@router.get("/models")
async def list_models(serving: ServingDep) -> dict[str, Any]:
    model = {
        "id": serving.settings.model_name,
        "object": "model",
        "created": int(serving.started_at),
        "owned_by": "slotserve",
        "max_model_len": serving.settings.max_model_len,
        "profile": serving.settings.profile,  # the GPU the step clock imitates (null: none)
    }
    adapters = [
        {"id": a.name, "object": "model", "created": int(serving.started_at),
         "owned_by": "slotserve", "root": a.path, "parent": a.parent}
        for a in serving.loras.adapters.values()
    ]  # fmt: skip
    return {"object": "list", "data": [model, *adapters]}


@router.post("/completions", responses=ERROR_RESPONSES)
async def completions(
    body: CompletionRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    ids = completion_prompt_ids(body, serving)
    max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
    run = _start(request, serving, body, ids, max_tokens, "cmpl", key_name)
    shape = CompletionShape(run.id, body.model or serving.settings.model_name)
    response = await _respond(run, body, request, serving, shape)
    return flag_ignored_priority(response, serving, body.priority)


@router.post("/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    ids = serving.tokenizer.chat_prompt([(m.role, m.text()) for m in body.messages])
    # max_completion_tokens replaces the deprecated max_tokens; it wins when both are set
    max_tokens = (
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    )
    run = _start(request, serving, body, ids, max_tokens, "chatcmpl", key_name)
    shape = ChatShape(run.id, body.model or serving.settings.model_name)
    response = await _respond(run, body, request, serving, shape)
    return flag_ignored_priority(response, serving, body.priority)


def completion_prompt_ids(body: CompletionRequest, serving: Serving) -> list[int]:
    """A completion prompt (text, token ids, or a one-element list of either) as token ids."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return serving.tokenizer.encode(prompt)
    first = prompt[0]
    if isinstance(first, str):
        return serving.tokenizer.encode(first)
    if isinstance(first, list):
        return list(first)
    return [token for token in prompt if isinstance(token, int)]


@dataclass
class Run:
    """One OpenAI request in flight: its engine stream and its text post-processing."""

    id: str
    stream: RequestStream
    matcher: StopStringMatcher
    created: int


def _start(
    request: Request,
    serving: Serving,
    body: OpenAIParams,
    ids: list[int],
    max_tokens: int | None,
    prefix: str,
    key_name: str | None,
) -> Run:
    rank = data_parallel_rank(request, serving)
    try:
        lora = serving.adapter(body.model)  # the base model, a LoRA adapter, or 404
    except LookupError:
        raise model_not_found(str(body.model), serving.settings.model_name) from None
    unsupported = body.unsupported()
    if unsupported is not None:
        raise APIError(400, f"{unsupported} is not supported by this server (the mock has no "
                       "log-probabilities, tools or structured output); leave it unset",
                       param=unsupported, code="unsupported_parameter")  # fmt: skip
    stops = body.stop_strings()
    params = GenerationParams(
        prompt=ids, max_tokens=max_tokens, stop_token_ids=body.stop_token_ids,
        stop_strings=stops, ignore_eos=body.ignore_eos, priority=body.priority,
        sampling=body.sampling(), user=key_name if key_name is not None else body.user,
        key_name=key_name, lora=lora,
    )  # fmt: skip
    stream = faults.submit(request, serving, params, streaming=bool(body.stream),
                           id_prefix=prefix, model=body.model, rank=rank)  # fmt: skip
    return Run(stream.request_id, stream, StopStringMatcher(stops), int(time.time()))


async def _texts(run: Run, serving: Serving) -> AsyncIterator[tuple[str, str | None]]:
    """(text delta, finish reason or None) pairs. The engine ends a request at the step whose
    tokens complete a stop string; here the text is cut right before it."""
    decoder = serving.tokenizer.stream_decoder()
    async for delta in run.stream:
        text = run.matcher.feed(decoder.feed(delta.tokens))
        if run.matcher.hit:
            yield text, FinishReason.STOP.value
            return
        if delta.finish_reason is FinishReason.ERROR:
            raise _ModelFailed(run.stream)
        if delta.finish_reason is not None:
            text += run.matcher.feed(decoder.flush()) + run.matcher.flush()
            yield text, delta.finish_reason.value
            return
        if text:
            yield text, None


class _ModelFailed(Exception):
    def __init__(self, stream: RequestStream) -> None:
        super().__init__(model_failed_message(stream.seq.error))


def _usage(stream: RequestStream) -> dict[str, int]:
    seq = stream.seq
    return {
        "prompt_tokens": seq.prompt_len,
        "completion_tokens": seq.num_generated,
        "total_tokens": seq.prompt_len + seq.num_generated,
    }


async def _respond(
    run: Run, body: OpenAIParams, request: Request, serving: Serving, shape: Shape
) -> Response:
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream_chunks(run, serving, shape, usage)
        return sse_response(chunks, run.stream, serving)
    abort = lambda: serving.abort(run.id)  # noqa: E731
    text, reason = await until_disconnected(request, _collect(run, serving), abort)
    return JSONResponse(shape.whole(text, reason, _usage(run.stream), run.created))


async def _collect(run: Run, serving: Serving) -> tuple[str, str | None]:
    parts: list[str] = []
    reason: str | None = None
    try:
        async for text, reason in _texts(run, serving):  # noqa: B007
            parts.append(text)
    except _ModelFailed as err:
        raise APIError(500, str(err), "server_error", code="model_error") from err
    return "".join(parts), reason


async def _stream_chunks(
    run: Run, serving: Serving, shape: Shape, include_usage: bool
) -> AsyncIterator[bytes]:
    for first in shape.opening(run.created):
        yield sse_event(None, first)
    try:
        async for text, reason in _texts(run, serving):
            yield sse_event(None, shape.chunk(text, reason, run.created))
    except _ModelFailed as err:
        yield sse_event(None, error_body(str(err), "server_error", None, "model_error"))
        return
    if include_usage:
        yield sse_event(None, shape.usage_chunk(_usage(run.stream), run.created))
    yield DONE


class Shape:
    """How one route lays out its response objects."""

    object_whole = ""
    object_chunk = ""

    def __init__(self, request_id: str, model: str) -> None:
        self.id, self.model = request_id, model

    def envelope(self, obj: str, created: int, choices: list[Any]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": created, "model": self.model,
                "choices": choices}  # fmt: skip

    def opening(self, created: int) -> list[dict[str, Any]]:
        return []

    def whole(
        self, text: str, reason: str | None, usage: dict[str, int], created: int
    ) -> dict[str, Any]:
        return self.envelope(self.object_whole, created, [self.choice(text, reason)]) | {
            "usage": usage
        }

    def chunk(self, text: str, reason: str | None, created: int) -> dict[str, Any]:
        return self.envelope(self.object_chunk, created, [self.delta(text, reason)])

    def usage_chunk(self, usage: dict[str, int], created: int) -> dict[str, Any]:
        return self.envelope(self.object_chunk, created, []) | {"usage": usage}

    choice: Callable[..., dict[str, Any]]
    delta: Callable[..., dict[str, Any]]


class CompletionShape(Shape):
    object_whole = object_chunk = "text_completion"

    def choice(self, text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

    delta = choice


class ChatShape(Shape):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def opening(self, created: int) -> list[dict[str, Any]]:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return [self.envelope(self.object_chunk, created, [first])]

    def choice(self, text: str, reason: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}

    def delta(self, text: str, reason: str | None) -> dict[str, Any]:
        content = {"content": text} if text else {}
        return {"index": 0, "delta": content, "finish_reason": reason, "logprobs": None}
