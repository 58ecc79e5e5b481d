"""A KV-event subscriber for tests: vLLM's event schema written here from
``vllm/distributed/kv_events.py`` (independently of app/kv_events/schema.py), the hashes a router
computes from token ids (vLLM's ``hash_block_tokens``, reimplemented), and a pyzmq SUB + replay
client that keeps the books (blocks stored minus blocks removed)."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import cbor2
import msgspec
import zmq

from app.engine.prefix_cache import CachedBlock

BS = 4


# --- vLLM's schema, as its source defines it ---------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Recent:
    """Recent vLLM's schema: the same structs without ``array_like`` (maps), with the fields
    it added since (defaults, omitted when unset)."""

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent, tag="BlockStored"):  # (nested: its own name as the tag)
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
        ts: float
        events: list[Recent.BlockStored | Recent.BlockRemoved | Recent.AllBlocksCleared]
        data_parallel_rank: int | None = None


class V026Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM 0.24-0.26's batch (the events maps since vllm#42892, the batch still an array)."""

    ts: float
    events: list[Recent.BlockStored | Recent.BlockRemoved | Recent.AllBlocksCleared]
    data_parallel_rank: int | None = None


# --- vLLM's block hash, reimplemented ----------------------------------------------------------


def vllm_hashes(
    tokens: list[int], algo: str = "sha256", seed: str = "0", lora: str | None = None
) -> list[int]:
    def h(value: Any) -> bytes:
        if algo == "sha256":
            return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    parent, out, extra = h(seed), [], None if lora is None else (lora,)
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = h((parent, tuple(tokens[start : start + BS]), extra))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def chain_tokens(block: CachedBlock) -> list[int]:
    links: list[CachedBlock] = []
    node: CachedBlock | None = block
    while node is not None:
        links.append(node)
        node = node.parent
    return [t for link in reversed(links) for t in link.tokens]


# --- a subscriber -----------------------------------------------------------------------------


class Subscriber:
    """SUB + DEALER (replay) sockets; ``batches`` by sequence number."""

    def __init__(
        self, endpoint: str, replay: str, topic: bytes = b"", decoder: Any = DECODER
    ) -> None:
        self.decoder = decoder
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.batches: dict[int, Any] = {}
        self.topics: set[bytes] = set()

    def receive(self, timeout_ms: int = 50) -> int:
        """Take every message the SUB socket has; returns how many."""
        got = 0
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            self.batches[int.from_bytes(seq, "big")] = self.decoder.decode(payload)
            got += 1
        return got

    def replay_from(self, start: int) -> list[int]:
        """Ask for every buffered batch from ``start``; returns the sequence numbers replayed."""
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        seqs: list[int] = []
        while True:
            assert self.replay.poll(5000), "no replay answer"
            empty, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return seqs
            self.batches[seq] = self.decoder.decode(payload)
            seqs.append(seq)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.ctx.term()

    def books(self, rank: int = 0) -> set[int | bytes]:
        """Stored minus removed over every batch in order; checks each batch's shape."""
        held: set[int | bytes] = set()
        for seq in sorted(self.batches):
            batch = self.batches[seq]
            assert batch.data_parallel_rank == rank
            for event in batch.events:
                kind = type(event).__name__
                if kind == "BlockStored":
                    assert event.parent_block_hash is None or event.parent_block_hash in held
                    assert len(event.token_ids) == BS * len(event.block_hashes)
                    assert event.block_size == BS and event.medium == "GPU"
                    assert not held & set(event.block_hashes)
                    held |= set(event.block_hashes)
                elif kind == "BlockRemoved":
                    assert set(event.block_hashes) <= held
                    held -= set(event.block_hashes)
                else:
                    assert kind == "AllBlocksCleared"
                    held.clear()
        return held
