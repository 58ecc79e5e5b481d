"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

- ``/tokenize``: a ``prompt`` (text, encoded as a completion prompt is) or chat ``messages``
  (through the model's chat template, the assistant's turn opened as for a chat completion);
  answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``: each token as
  the vocabulary spells it, ``"Ġcapital"``, as vLLM returns them; a tokenizer without a
  vocabulary of strings, the mock's bytes, gives each token's text; with
  ``return_token_strs: true``, else null).
- ``/detokenize``: ``tokens`` -> ``{"prompt": text}``; an id outside the vocabulary decodes to
  nothing, as vLLM answers it (200), a negative one is a 400.

``model``, when given, must be the served model (404 otherwise), as on the OpenAI routes.

The tokenizer's work and the answer's encoding run on one worker thread (``WORKER``), never on
the event loop: a 1 MiB prompt costs about a second of Python to answer (most of it encoding a
million ids), which on the loop stalled every other request, ``/health`` too. One thread, so
concurrent calls queue for it instead of contending with the loop. Their bodies are bounded
by ``MAX_BODY_BYTES`` whatever ``--max-body-bytes`` is (app/api/limits.py), which bounds the
work and the answer (about 10 bytes per prompt byte with ``token_strs``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, Field

from app.api.deps import ServingDep
from app.api.errors import ERROR_RESPONSES, InvalidField, model_not_found, schema_error
from app.api.schemas import ChatMessage, Text, TokenId
from app.models.tokenizer import Tokenizer
from app.serving import Serving

router = APIRouter(tags=["tokenizer"])
ROUTES = ("/tokenize", "/detokenize")
MAX_BODY_BYTES = 1 << 20  # these routes' body limit (the lower of it and --max-body-bytes)
WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slotserve-tokenizer")


async def off_the_loop(work: Callable[[], Any]) -> Response:
    """``work()``'s answer, computed and JSON-encoded on ``WORKER``."""
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(WORKER, lambda: msgspec.json.encode(work()))
    return Response(body, media_type="application/json")


class TokenizeRequest(BaseModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # only the route's default is honoured
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: Text | None = None
    tokens: list[TokenId]


def _check_model(serving: Serving, model: str | None) -> None:
    if model is not None and model != serving.settings.model_name:
        raise model_not_found(model, serving.settings.model_name)


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, serving: ServingDep) -> Response:
    """The token ids of a prompt or a chat, as the generation routes would feed them."""
    _check_model(serving, body.model)
    if body.prompt is None and body.messages is None:  # vLLM's schema refuses it
        raise schema_error("prompt: Field required (give prompt or messages)", "prompt", "missing")
    if body.prompt is not None and body.messages is not None:
        raise InvalidField("give either prompt or messages, not both", param="prompt",
                           code="invalid_value")  # fmt: skip
    if body.messages is not None:
        _only(body.add_special_tokens, False, "add_special_tokens")
        _only(body.add_generation_prompt, True, "add_generation_prompt")
    else:
        _only(body.add_special_tokens, True, "add_special_tokens")
    tokenizer, max_model_len = serving.tokenizer, serving.settings.max_model_len

    def answer() -> dict[str, Any]:
        if body.messages is not None:
            tokens = tokenizer.chat_prompt([(m.template_role(), m.text()) for m in body.messages])
        else:
            tokens = tokenizer.encode(body.prompt or "")
        strs = _spelling(tokenizer, tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
                "token_strs": strs}  # fmt: skip

    return await off_the_loop(answer)


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> Response:
    """The text of token ids (special tokens skipped, as in generated text)."""
    _check_model(serving, body.model)
    tokenizer = serving.tokenizer
    known = [t for t in body.tokens if t < tokenizer.vocab_size]  # as vLLM: others decode to ""
    return await off_the_loop(lambda: {"prompt": tokenizer.decode(known)})


def _spelling(tokenizer: Tokenizer, tokens: list[int]) -> list[str]:
    """``tokens`` as the vocabulary spells them (a tokenizer with ``spell``), else their text."""
    spell: Callable[[list[int]], list[str]] | None = getattr(tokenizer, "spell", None)
    return spell(tokens) if spell is not None else [tokenizer.decode([t]) for t in tokens]


def _only(value: bool | None, default: bool, param: str) -> None:
    """This server applies each route's default only (the tokenizer protocol has no switch)."""
    if value is not None and value != default:
        raise InvalidField(f"{param} can only be {str(default).lower()} here", param=param,
                           code="unsupported_parameter")  # fmt: skip
