"""Dependencies: the serving context and the authenticated API key's name. Both are async, so
FastAPI runs them on the event loop instead of sending each request through its thread pool.
Also the generation routes' reading of the ``x-data-parallel-rank`` header."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.api.auth import STATE_KEY
from app.api.errors import InvalidField
from app.serving import Serving


async def get_serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


async def get_key_name(request: Request) -> str | None:
    """The name of the API key the request was authenticated with (``app.api.auth``), or None
    when the server has no keys."""
    name: str | None = getattr(request.state, STATE_KEY, None)
    return name


RANK_HEADER = "x-data-parallel-rank"
RANK_DIGITS = 9  # leading zeros allowed; ranks stop at 64


def data_parallel_rank(request: Request, serving: Serving) -> int | None:
    """The rank the ``x-data-parallel-rank`` header names (None: absent, the least loaded
    rank serves); 400 unless it is an integer in [0, --data-parallel-size) written in at most
    ``RANK_DIGITS`` ASCII digits (``str.isdigit`` also takes digits ``int`` refuses, such as
    ``²``; past 4,300 digits ``int`` itself refuses). The message quotes at most 32 characters."""
    value = request.headers.get(RANK_HEADER)
    if value is None:
        return None
    ranks, text = serving.settings.data_parallel_size, value.strip()
    digits = text.isascii() and text.isdigit() and len(text) <= RANK_DIGITS
    rank = int(text) if digits else -1
    if not 0 <= rank < ranks:
        shown = value if len(value) <= 32 else value[:32] + "..."
        raise InvalidField(f"{RANK_HEADER} must be an integer in [0, {ranks}), got {shown!r}",
                           param=RANK_HEADER, code="invalid_data_parallel_rank")  # fmt: skip
    return rank


ServingDep = Annotated[Serving, Depends(get_serving)]
KeyNameDep = Annotated[str | None, Depends(get_key_name)]
