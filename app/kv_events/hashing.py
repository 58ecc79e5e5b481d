"""Block hashes in vLLM's scheme, so a router that hashes token ids itself agrees with ours.

vLLM (``vllm/v1/core/kv_cache_utils.py``): block ``i`` of a prompt hashes
``H((parent, tuple(token_ids of block i), extra_keys))`` where ``parent`` is block ``i-1``'s
hash, or for the first block ``NONE_HASH = H(seed)`` with the seed vLLM reads from
``PYTHONHASHSEED`` (here ``--prefix-caching-hash-seed``). ``H`` is ``--prefix-caching-hash-algo``:
``sha256`` (SHA-256 of the pickled tuple, vLLM's default) or ``sha256_cbor`` (SHA-256 of its
canonical CBOR, language-neutral). ``extra_keys`` is None for a plain text prompt, and
``(adapter name,)`` for a LoRA request's blocks, as in vLLM. An event
carries the hash's low 64 bits (big-endian) as an integer, as vLLM does by default.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any, Literal

import cbor2

from app.engine.prefix_cache import CachedBlock

HashAlgo = Literal["sha256", "sha256_cbor"]
INT64_MASK = (1 << 64) - 1


def sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256, "sha256_cbor": sha256_cbor}


def external(digest: bytes, as_int: bool = True) -> int | bytes:
    """A digest as an event carries it: its low 64 bits as an integer, or the bytes."""
    return int.from_bytes(digest, "big") & INT64_MASK if as_int else digest


class BlockHasher:
    """Computes (once per block, memoized on the block) the vLLM hash of a cached block."""

    def __init__(self, algo: HashAlgo = "sha256", seed: str = "0") -> None:
        self.fn = HASH_FUNCTIONS[algo]
        self.none_hash = self.fn(seed)

    def token_hashes(
        self, token_ids: list[int], block_size: int, lora: str | None = None
    ) -> list[bytes]:
        """The hashes of the full blocks of ``token_ids`` (what a router computes)."""
        out: list[bytes] = []
        parent, extra = self.none_hash, None if lora is None else (lora,)
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = self.fn((parent, tuple(token_ids[start : start + block_size]), extra))
            out.append(parent)
        return out

    def digest(self, block: CachedBlock) -> bytes:
        """``block``'s hash, hashing the uncomputed part of its chain first."""
        if block.digest is not None:
            return block.digest
        chain: list[CachedBlock] = []
        node: CachedBlock | None = block
        while node is not None and node.digest is None:
            chain.append(node)
            node = node.parent
        parent = self.none_hash if node is None or node.digest is None else node.digest
        for link in reversed(chain):
            extra = None if link.lora is None else (link.lora,)
            link.digest = parent = self.fn((parent, link.tokens, extra))
        return parent
