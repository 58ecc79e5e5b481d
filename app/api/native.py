"""The native API: ``POST /generate`` (SSE or JSON) and ``DELETE /requests/{id}``, an event
shaper over ``app.api.generation``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api import generation
from app.api.deps import KeyNameDep, ServingDep
from app.api.errors import ERROR_RESPONSES, APIError, NotFound, documented, response_for
from app.api.generation import EventShaper, Outcome, Piece, Run
from app.api.schemas import GenerateRequest
from app.api.streaming import sse_event
from app.api.tool_reader import Part
from app.serving import Serving

router = APIRouter(tags=["native"])


@router.post("/generate", responses=ERROR_RESPONSES)
async def generate(
    body: GenerateRequest, request: Request, serving: ServingDep, key_name: KeyNameDep
) -> Response:
    """Generate tokens for one prompt: an SSE stream of ``token`` events then one ``done`` (or
    ``error``) event, or with ``stream: false`` one JSON object shaped like ``done``."""
    prompt = serving.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
    internal = generation.InternalRequest(
        prompt=prompt, max_tokens=body.max_tokens, stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, request_id=body.request_id, priority=body.priority,
        sampling=body.sampling(), bad_words=body.bad_words or [], user=body.user,
        stream=body.stream,
    )  # fmt: skip
    run = generation.start(request, serving, internal, key_name)
    response: Response
    if body.stream:
        response = generation.stream_response(run, serving, NativeEvents(run, serving))
    else:
        try:
            await generation.whole_reply(request, run, serving)
            response = JSONResponse(done_payload(run, serving))
        except APIError as err:  # a failed model call's answer
            response = response_for(err, {"request_id": run.id})
    return generation.flag_priority(response, serving, internal)


@router.delete("/requests/{request_id}", responses=documented((NotFound, "unknown request")))
async def cancel(request_id: str, serving: ServingDep, key_name: KeyNameDep) -> dict[str, object]:
    """Cancel a waiting or running request; its stream ends with ``finish_reason: abort``. The
    answer comes once the engine has applied the abort, so the id can be reused at once. With
    API keys, another key's request is a 404, as an unknown one."""
    if not await serving.ranks.cancel(request_id, key_name):
        raise NotFound(f"no live request with id {request_id!r}",
                       param="request_id", code="request_not_found")  # fmt: skip
    return {"request_id": request_id, "cancelled": True}


class NativeEvents(EventShaper):
    """``token`` events (the piece's token ids and text), then ``done`` or ``error``."""

    def __init__(self, run: Run, serving: Serving) -> None:
        self.run, self.serving = run, serving
        self.head = f'event: token\ndata: {{"request_id":{json.dumps(run.id)},"tokens":['

    def pieces(self, piece: Piece, parts: list[Part]) -> Iterable[bytes]:
        if not (piece.tokens or piece.text):
            return ()
        ids = ",".join(map(str, piece.tokens))  # the hot path: by hand, the JSON json.dumps writes
        return (f'{self.head}{ids}],"text":{json.dumps(piece.text)}}}\n\n'.encode(),)

    def ending(self, outcomes: list[Outcome]) -> Iterable[bytes]:
        yield sse_event("done", done_payload(self.run, self.serving))

    def failure(self, error: APIError) -> Iterable[bytes]:
        yield sse_event(
            "error", error.body() | {"request_id": self.run.id, "error_code": error.code}
        )


def done_payload(run: Run, serving: Serving) -> dict[str, Any]:
    view = run.stream.view
    tokens = view.generated
    return {
        "request_id": view.request_id,
        "finish_reason": view.finish_reason.value if view.finish_reason else None,
        "tokens": tokens,
        "text": serving.tokenizer.decode(tokens),
        "usage": {"prompt_tokens": view.prompt_len, "completion_tokens": len(tokens)},
    }
