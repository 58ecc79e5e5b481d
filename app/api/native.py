"""The native API: ``POST /generate`` (SSE or JSON) and ``DELETE /requests/{id}``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api import faults
from app.api.deps import KeyNameDep, ServingDep, data_parallel_rank
from app.api.errors import APIError, error_body, model_failed_message
from app.api.schemas import GenerateRequest
from app.api.streaming import sse_event, sse_response, until_disconnected
from app.engine.stream import RequestStream
from app.engine.types import FinishReason
from app.serving import GenerationParams, Serving

router = APIRouter(tags=["native"])

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "invalid request"},
    401: {"description": "missing or invalid API key"},
    409: {"description": "a live request already has this request_id"},
    413: {"description": "body too large"},
    429: {"description": "waiting queue full (see Retry-After)"},
    503: {"description": "draining or engine dead"},
}


@router.post("/generate", responses=ERROR_RESPONSES)
async def generate(
    body: GenerateRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    """Generate tokens for one prompt: an SSE stream of ``token`` events then one ``done`` (or
    ``error``) event, or with ``stream: false`` one JSON object shaped like ``done``."""
    prompt = serving.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
    params = GenerationParams(
        prompt=prompt,
        max_tokens=body.max_tokens,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        request_id=body.request_id,
        priority=body.priority,
        sampling=body.sampling(),
        bad_words=body.bad_words or [],
        user=key_name if key_name is not None else body.user,
        key_name=key_name,
    )
    rank = data_parallel_rank(request, serving)
    stream = faults.submit(request, serving, params, streaming=body.stream, rank=rank)
    if body.stream:
        response: Response = sse_response(native_events(stream, serving), stream, serving)
        return flag_ignored_priority(response, serving, body.priority)
    await until_disconnected(request, stream.collect(), lambda: serving.abort(stream.request_id))
    if stream.seq.finish_reason is FinishReason.ERROR:
        response = JSONResponse(error_payload(stream), status_code=500)
    else:
        response = JSONResponse(done_payload(stream, serving))
    return flag_ignored_priority(response, serving, body.priority)


PRIORITY_IGNORED = "x-slotserve-priority-ignored"


def flag_ignored_priority(response: Response, serving: Serving, priority: int) -> Response:
    """Mark a response whose request asked for a priority the policy ignores (any policy but
    ``priority``), so the priority is not silently dropped."""
    if serving.priority_ignored(priority):
        response.headers[PRIORITY_IGNORED] = "1"
    return response


@router.delete("/requests/{request_id}", responses={404: {"description": "unknown request"}})
async def cancel(request_id: str, serving: ServingDep, key_name: KeyNameDep) -> dict[str, object]:
    """Cancel a waiting or running request; its stream ends with ``finish_reason: abort``. The
    answer comes once the engine has applied the abort, so the id can be reused at once. With
    API keys, another key's request is a 404, as an unknown one."""
    if not await serving.cancel(request_id, key_name):
        raise APIError(404, f"no live request with id {request_id!r}", "not_found_error",
                       param="request_id", code="request_not_found")  # fmt: skip
    return {"request_id": request_id, "cancelled": True}


async def native_events(stream: RequestStream, serving: Serving) -> AsyncIterator[bytes]:
    decoder = serving.tokenizer.stream_decoder()
    head = f'event: token\ndata: {{"request_id":{json.dumps(stream.request_id)},"tokens":['
    async for delta in stream:
        text = decoder.feed(delta.tokens) if delta.tokens else ""
        if delta.finish_reason is not None:
            text += decoder.flush()  # a character cut off by the end shows as U+FFFD
        if delta.tokens or text:  # the hot path: built by hand, the same JSON json.dumps writes
            ids = ",".join(map(str, delta.tokens))
            yield f'{head}{ids}],"text":{json.dumps(text)}}}\n\n'.encode()
        if delta.finish_reason is FinishReason.ERROR:
            yield sse_event("error", error_payload(stream))
        elif delta.finish_reason is not None:
            yield sse_event("done", done_payload(stream, serving))


def done_payload(stream: RequestStream, serving: Serving) -> dict[str, Any]:
    seq = stream.seq
    tokens = seq.generated
    return {
        "request_id": seq.request_id,
        "finish_reason": seq.finish_reason.value if seq.finish_reason else None,
        "tokens": tokens,
        "text": serving.tokenizer.decode(tokens),
        "usage": {"prompt_tokens": seq.prompt_len, "completion_tokens": len(tokens)},
    }


def error_payload(stream: RequestStream) -> dict[str, Any]:
    body = error_body(model_failed_message(stream.seq.error), "server_error", None, "model_error")
    body["request_id"] = stream.request_id
    return body
