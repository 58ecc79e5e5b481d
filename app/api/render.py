"""``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``, in vLLM's shapes.

A render is the token-in request a generation request becomes, computed without generating:
llm-d's precise prefix-cache routing calls these routes to learn a prompt's token ids, then
hashes their blocks as the KV events do. The bodies are those of ``/v1/completions`` and
``/v1/chat/completions``, read the same way (the same prompt encoding, chat template, tool
rendering and model check: 404 ``model_not_found`` for a model that is neither the served one
nor a loaded adapter). The answer is vLLM's ``GenerateRequest``
(``vllm/entrypoints/serve/disagg/protocol.py``): ``{"request_id", "token_ids", "features",
"sampling_params", "model", "stream", "stream_options", "cache_salt", "priority",
"kv_transfer_params", "token_offsets"}``; a completion answers a list of them, one per prompt
(``request_id`` ``cmpl-...``), a chat one object (``chatcmpl-...``). ``sampling_params`` carries
the fields this server honours, under vLLM's names, with ``max_tokens`` resolved as the
generation route would (a prompt that leaves no room for them is refused as there: 400
``context_length_exceeded``). ``features``, ``kv_transfer_params`` and ``token_offsets`` are
null.

The tokenizer's work runs on the tokenizer routes' worker thread, and the bodies are bounded by
their limit (``app/api/tokenize.py``).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from app.api.deps import ServingDep
from app.api.errors import ERROR_RESPONSES
from app.api.generation import adapter
from app.api.openai_compat import DEFAULT_COMPLETION_TOKENS, completion_prompts
from app.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIParams
from app.api.tokenize import off_the_loop
from app.api.tools import chat_prompt, tool_plan
from app.serving import Serving, context_length_error

router = APIRouter(prefix="/v1", tags=["routers"])
ROUTES = ("/v1/completions/render", "/v1/chat/completions/render")


@router.post("/completions/render", responses=ERROR_RESPONSES)
async def render_completion(body: CompletionRequest, serving: ServingDep) -> Response:
    """Each prompt's token-in request (a list, in the prompts' order)."""
    adapter(serving, body.model)
    requested = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens

    def answer() -> list[dict[str, Any]]:
        return [
            _generate_request("cmpl", ids, body, requested, serving)
            for ids in completion_prompts(body, serving)
        ]

    return await off_the_loop(answer)


@router.post("/chat/completions/render", responses=ERROR_RESPONSES)
async def render_chat_completion(body: ChatCompletionRequest, serving: ServingDep) -> Response:
    """The chat's token-in request: its prompt through the chat template, as generation does."""
    adapter(serving, body.model)
    plan = tool_plan(body, serving)
    requested = (
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    )
    return await off_the_loop(
        lambda: _generate_request(
            "chatcmpl", chat_prompt(body.messages, plan, serving), body, requested, serving
        )
    )


def _generate_request(
    kind: str, ids: list[int], body: OpenAIParams, requested: int | None, serving: Serving
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for prompt ``ids`` of ``body``; 400
    ``context_length_exceeded`` (as generation answers) when the prompt and ``requested``
    tokens do not fit in the context."""
    context = serving.settings.max_model_len
    if len(ids) > context or (requested is not None and len(ids) + requested > context):
        raise context_length_error(len(ids), requested or 0, context)
    sampling = body.sampling()
    params = {
        "n": body.n or 1,
        "temperature": 1.0 if sampling.temperature is None else sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "seed": sampling.seed,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "stop": body.stop_strings(),
        "stop_token_ids": list(body.stop_token_ids),
        "ignore_eos": body.ignore_eos,
        "max_tokens": serving.output_tokens(len(ids), requested),
        "min_tokens": sampling.min_tokens,
        "logprobs": body.top_logprobs_asked(),
        "prompt_logprobs": body.prompt_logprobs,
    }
    stream = bool(body.stream)
    options = body.stream_options.model_dump() if stream and body.stream_options else None
    return {
        "request_id": f"{kind}-{uuid.uuid4().hex}",
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
