"""vLLM's KV-cache event schema (``vllm/distributed/kv_events.py``), written from its source.

A batch is a msgpack array ``[ts, [event, ...], data_parallel_rank]``; each event is a tagged
array whose first item is the class name: ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes,
medium]``, ``["AllBlocksCleared"]``. This is the ``array_like`` layout vLLM has published since
KV events appeared (and that llm-d's KV-cache manager and Dynamo decode). Block hashes are
64-bit integers by default (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the raw
digest bytes.

Since vllm-project/vllm#42892 (vLLM 0.24 on; v0.26.0 captured in volcano-sh/kthena#1535) the
events are maps instead (``{"type": "BlockStored", "block_hashes": ..., "extra_keys": ...}``)
inside the same array batch: ``Map*`` events in ``MapEventsBatch`` (``--kv-events-encoding
map``, the default). vLLM's main branch (``vllm/distributed/kv_events.py`` at 0181ea3) makes the
batch a map too, ``{"ts", "events", "data_parallel_rank"}``: ``MapKVEventBatch``
(``--kv-events-encoding map-batch``).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The map layouts: the same events and fields, encoded as maps tagged by the ``type`` key (the
# class name, as above); ``MapBlockStored`` adds vLLM's ``extra_keys``.
class MapBlockStored(BlockStored, array_like=False, tag="BlockStored"):
    extra_keys: list[tuple[str] | None] | None = None  # per block: None or (lora_name,)


class MapBlockRemoved(BlockRemoved, array_like=False, tag="BlockRemoved"):
    pass


class MapAllBlocksCleared(AllBlocksCleared, array_like=False, tag="AllBlocksCleared"):
    pass


class MapEventsBatch(EventBatch):
    """vLLM 0.24-0.26's batch: an array ``[ts, [map events], data_parallel_rank]``."""

    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


class MapKVEventBatch(MapEventsBatch, array_like=False):
    """vLLM main's batch: a map ``{"ts", "events", "data_parallel_rank"}``."""
