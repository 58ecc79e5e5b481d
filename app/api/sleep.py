"""vLLM's sleep-mode routes (its dev-mode shapes), mounted with ``--enable-sleep-mode``:

- ``POST /sleep?level=1|2``: 200 (empty body) once asleep; generation then gets 503
  ``sleeping`` and ``/health`` 503 ``sleeping``.
- ``POST /wake_up`` (optionally ``?tags=weights&tags=kv_cache``): 200 (empty body).
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from app.api.deps import ServingDep
from app.api.errors import InvalidField, documented

router = APIRouter(tags=["sleep mode"])


@router.post("/sleep", responses=documented((InvalidField, "a level other than 1 or 2")))
async def sleep(serving: ServingDep, level: Annotated[str, Query()] = "1") -> Response:
    """Put the server to sleep: requests in flight end with ``abort``, the prefix cache is
    emptied (KV events: ``AllBlocksCleared``), generation is refused until ``/wake_up``."""
    if level not in ("1", "2"):
        raise InvalidField(f"level must be 1 or 2, got {level!r}", param="level",
                           code="invalid_sleep_level")  # fmt: skip
    await serving.sleep(int(level))
    return Response()


@router.post("/wake_up", responses=documented((InvalidField, "an unknown tag")))
async def wake_up(
    serving: ServingDep, tags: Annotated[list[str] | None, Query()] = None
) -> Response:
    """Wake the named parts up (``weights``, ``kv_cache``; none named: everything)."""
    try:
        serving.readiness.wake_up(tags or None)
    except ValueError as err:
        raise InvalidField(str(err), param="tags", code="invalid_wake_up_tag") from None
    return Response()


@router.get("/is_sleeping")
async def is_sleeping(serving: ServingDep) -> dict[str, bool]:
    """vLLM's ``GET /is_sleeping``: true from ``/sleep`` until a full ``/wake_up``."""
    return {"is_sleeping": bool(serving.readiness.asleep)}
