"""A request's ``kv_transfer_params``, validated into what this server must do with it.

vLLM's shapes: a prefill request sends ``{"do_remote_decode": true}`` (the vLLM router also sends
``do_remote_prefill: false`` and the ``remote_*`` keys as null); the producer answers
``{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id", "remote_request_id",
"remote_block_ids", "remote_host", "remote_port", "tp_size"}``, which the router passes on to the
decode request unchanged. Keys we do not read are ignored, as vLLM ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_BLOCK_IDS = 1 << 20  # a million blocks: far past any context a request can have
MAX_TEXT = 256  # engine ids, request ids and host names


class TransferParamsError(ValueError):
    """``kv_transfer_params`` of the wrong shape; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RemoteBlocks:
    """Where a decode request's prompt KV is held: the producer and its block ids."""

    engine_id: str
    request_id: str | None
    block_ids: tuple[int, ...]
    host: str
    port: int
    tp_size: int = 1


@dataclass(frozen=True, slots=True)
class TransferIntent:
    """What the request asks: hold its blocks for a remote decoder, or pull them from one."""

    remote_decode: bool = False
    remote_prefill: RemoteBlocks | None = None


def parse_transfer_params(raw: Any, field: str = "kv_transfer_params") -> TransferIntent | None:
    """The intent of ``raw`` (``None`` when it asks nothing); ``TransferParamsError`` if wrong."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TransferParamsError(f"{field} must be an object", field)
    decode = _flag(raw, "do_remote_decode", field)
    prefill = _flag(raw, "do_remote_prefill", field)
    if decode and prefill:
        raise TransferParamsError(
            f"{field}: do_remote_decode and do_remote_prefill cannot both be true", field
        )
    if prefill:
        return TransferIntent(remote_prefill=_remote_blocks(raw, field))
    return TransferIntent(remote_decode=True) if decode else None


def _flag(raw: dict[str, Any], key: str, field: str) -> bool:
    value = raw.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TransferParamsError(f"{field}.{key} must be a boolean", f"{field}.{key}")
    return value


def _remote_blocks(raw: dict[str, Any], field: str) -> RemoteBlocks:
    def text(key: str, required: bool = True) -> str | None:
        value = raw.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
            raise TransferParamsError(
                f"{field}.{key} must be a string of 1 to {MAX_TEXT} characters "
                "when do_remote_prefill is true",
                f"{field}.{key}",
            )
        return value

    def integer(key: str, low: int, high: int, default: int | None = None) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise TransferParamsError(
                f"{field}.{key} must be an integer from {low} to {high}", f"{field}.{key}"
            )
        return value

    ids = raw.get("remote_block_ids")
    if ids is None:
        ids = []
    elif isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]  # vLLM's newer layout: one list per KV-cache group (one group here)
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_BLOCK_IDS
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise TransferParamsError(
            f"{field}.remote_block_ids must be a list of at most {MAX_BLOCK_IDS} block ids "
            "(integers >= 0)",
            f"{field}.remote_block_ids",
        )
    engine, host = text("remote_engine_id"), text("remote_host")
    assert engine is not None and host is not None
    return RemoteBlocks(
        engine_id=engine,
        request_id=text("remote_request_id", required=False),
        block_ids=tuple(ids),
        host=host,
        port=integer("remote_port", 1, 65535),
        tp_size=integer("tp_size", 1, 1024, default=1),
    )
