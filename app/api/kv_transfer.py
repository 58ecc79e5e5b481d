"""Prefill/decode disaggregation at the HTTP edge (the design: ``app/kv_transfer/__init__.py``).

- ``intent``: a request's ``kv_transfer_params`` checked against this server's role (400 naming
  the field when wrong);
- ``receive``: a consumer's request with ``do_remote_prefill`` pulls its blocks from the producer
  and waits for them to cross the link before it is submitted; a failed pull falls back to a
  local prefill (counted in ``slotserve:kv_transfer_fallbacks_total{reason}`` and said in the
  ``x-kv-transfer`` header); a client that leaves meanwhile gets its blocks released anyway;
- ``POST /v1/kv_transfer/fetch``: the producer's side of the pull (our stand-in for NIXL's side
  channel): the held blocks are freed and ``{"num_tokens"}`` answered; 404 ``unknown_engine``
  or ``expired`` otherwise.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from app.api.deps import ServingDep
from app.api.errors import InvalidField, NotFound, documented
from app.api.streaming import until_disconnected
from app.engine.errors import QueueFullError
from app.kv_transfer.node import check_intent
from app.kv_transfer.params import MAX_BLOCK_IDS, MAX_TEXT, TransferIntent, TransferParamsError
from app.serving import Serving

log = logging.getLogger("slotserve.kv_transfer")
router = APIRouter(tags=["kv_transfer"])
HEADER = "x-kv-transfer"

Id = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]


class FetchRequest(BaseModel):
    """A consumer's pull: the producer's engine id, the request whose blocks it holds."""

    engine_id: Id
    request_id: Id
    block_ids: list[int] = Field(default_factory=list, max_length=MAX_BLOCK_IDS)


@router.post(
    "/v1/kv_transfer/fetch",
    responses=documented((NotFound, "unknown engine id, or the blocks are not held (expired)")),
)
async def fetch(body: FetchRequest, serving: ServingDep) -> dict[str, Any]:
    try:
        tokens = serving.release_kv_hold(body.engine_id, body.request_id)
    except LookupError as err:
        code = str(err.args[0])
        message = (
            f"engine {body.engine_id!r} is not this server's"
            if code == "unknown_engine"
            else f"no blocks are held for request {body.request_id!r} (expired, or pulled)"
        )
        raise NotFound(message, param="request_id", code=code) from None
    return {"num_tokens": tokens}


def intent(serving: Serving, raw: Any) -> TransferIntent | None:
    """``raw`` checked against this server's role (``check_intent``): 400 naming the field."""
    config = serving.kv_transfer.config if serving.kv_transfer is not None else None
    try:
        return check_intent(config, raw)
    except TransferParamsError as err:
        raise InvalidField(str(err), param=err.param, code="invalid_value") from None


async def receive(
    request: Request, serving: Serving, want: TransferIntent | None, prompt_len: int
) -> tuple[int, str]:
    """A ``do_remote_prefill`` request's blocks, pulled before it is submitted: (the prompt's
    leading tokens now computed, the ``x-kv-transfer`` header's value); (0, "") for any other
    request. A client that leaves meanwhile raises ``ClientGone`` (its blocks are released); a
    server with no room raises ``QueueFullError`` (429) before pulling, leaving them held."""
    transfer = serving.kv_transfer
    blocks = want.remote_prefill if want is not None else None
    if blocks is None or transfer is None:
        return 0, ""
    if not any(serving.has_room(rank) for rank in range(len(serving.engines))):
        # a 429 after the pull would have freed the producer's blocks for nothing: the retry
        # could only prefill locally
        settings = serving.settings
        raise QueueFullError.for_bounds(settings.num_slots, settings.max_waiting)
    pulled = await until_disconnected(
        request, transfer.receive(blocks, prompt_len), lambda: transfer.release(blocks)
    )
    if pulled.failure is not None:
        log.warning("KV pull from %s:%d failed (%s): prefilling locally",
                    blocks.host, blocks.port, pulled.failure)  # fmt: skip
        serving.metrics.kv_transfer_fallbacks.labels(
            serving.settings.model_name, pulled.failure
        ).inc()
        return 0, f"fallback; reason={pulled.failure}"
    return pulled.num_tokens, f"pulled; tokens={pulled.num_tokens}"


def mark(response: Response, note: str) -> Response:
    """Say how a ``do_remote_prefill`` request's blocks came (``x-kv-transfer``)."""
    if note:
        response.headers[HEADER] = note
    return response
