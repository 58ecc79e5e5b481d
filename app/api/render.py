"""``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``, in vLLM's shapes.

A render is the token-in request a generation request becomes, computed without generating:
llm-d's precise prefix-cache routing calls these routes to learn a prompt's token ids, then
hashes their blocks as the KV events do. The bodies are those of ``/v1/completions`` and
``/v1/chat/completions``, read by the same code (``completion_request``, ``chat_request``: the
same prompt encoding, chat template, tool rendering and checks) and each prompt checked as the
engine checks it (``Serving.prepare``: empty prompt, vocabulary, context length, KV capacity),
so a render answers the 400 or 404 the generation route would (a grammar is not compiled, and
a mock draws no tool decision). The answer is vLLM's ``GenerateRequest``
(``vllm/entrypoints/serve/disagg/protocol.py``): ``{"request_id", "token_ids", "features",
"sampling_params", "model", "stream", "stream_options", "cache_salt", "priority",
"kv_transfer_params", "token_offsets"}``; a completion answers a list of them, one per prompt
(``request_id`` ``cmpl-...``), a chat one object (``chatcmpl-...``). ``sampling_params`` carries
the fields this server honours, under vLLM's names, with ``max_tokens`` resolved as the
generation route would. ``features``, ``kv_transfer_params`` and ``token_offsets`` are
null.

The tokenizer's work runs on the tokenizer routes' worker thread, and the bodies are bounded by
their limit (``app/api/tokenize.py``).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from app.api.deps import ServingDep
from app.api.errors import ERROR_RESPONSES
from app.api.generation import InternalRequest, check_room, engine_params
from app.api.openai_compat import chat_request, completion_request
from app.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIParams
from app.api.tokenize import off_the_loop
from app.serving import Serving

router = APIRouter(prefix="/v1", tags=["routers"])
ROUTES = ("/v1/completions/render", "/v1/chat/completions/render")


@router.post("/completions/render", responses=ERROR_RESPONSES)
async def render_completion(body: CompletionRequest, serving: ServingDep) -> Response:
    """Each prompt's token-in request (a list, in the prompts' order)."""
    return await off_the_loop(
        lambda: _generate_requests(completion_request(body, serving), body, serving)
    )


@router.post("/chat/completions/render", responses=ERROR_RESPONSES)
async def render_chat_completion(body: ChatCompletionRequest, serving: ServingDep) -> Response:
    """The chat's token-in request: its prompt through the chat template, as generation does."""
    return await off_the_loop(
        lambda: _generate_requests(chat_request(body, serving, decide=False), body, serving)[0]
    )


def _generate_requests(
    internal: InternalRequest, body: OpenAIParams, serving: Serving
) -> list[dict[str, Any]]:
    """vLLM's ``GenerateRequest`` for each prompt of ``internal`` (the checked ``body``), each
    prompt checked as the engine would check it (``InvalidRequestError``: the route's 400)."""
    prompts = [internal.prompt, *internal.more_prompts]
    check_room(serving, len(prompts), internal.n, None)
    first = engine_params(internal, None, None)
    out = []
    for ids in prompts:  # no grammar: only the generation route compiles one
        seq = serving.prepare(dataclasses.replace(first, prompt=ids, constraint=None))
        out.append(_generate_request(ids, seq.max_tokens, internal, body))
    return out


def _generate_request(
    ids: list[int], max_tokens: int, internal: InternalRequest, body: OpenAIParams
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for prompt ``ids`` of ``body`` (``max_tokens``: resolved)."""
    sampling = internal.sampling
    params = {
        "n": internal.n,
        "temperature": 1.0 if sampling.temperature is None else sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "seed": sampling.seed,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "stop": internal.stop_strings,
        "stop_token_ids": list(internal.stop_token_ids),
        "ignore_eos": internal.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": sampling.min_tokens,
        "logprobs": body.top_logprobs_asked(),
        "prompt_logprobs": body.prompt_logprobs,
    }
    stream = bool(body.stream)
    options = body.stream_options.model_dump() if stream and body.stream_options else None
    return {
        "request_id": f"{internal.id_prefix}-{uuid.uuid4().hex}",
        "token_ids": ids,
        "features": None,
        "sampling_params": params,
        "model": body.model,
        "stream": stream,
        "stream_options": options,
        "cache_salt": None,
        "priority": body.priority,
        "kv_transfer_params": None,
        "token_offsets": None,
    }
