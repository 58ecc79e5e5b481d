"""Attention over the KV cache for one step's packed tokens.

A step packs every token it processes into one sequence: first one token per decoding slot,
then each prefill chunk's tokens. ``StepLayout`` describes that packing once per step (built by
``StepLayout.build``); every layer's attention then reads it:

- decode tokens: one batched ``scaled_dot_product_attention`` over a view of the cache for the
  slot range they span (no copy of the cache), each slot masked to its own length. A slot of the
  range that is not decoding gets a dummy query whose output is dropped. When the decoding slots
  fill at most half of that range, their keys and values are copied out instead (a drain tail of
  a few long requests in scattered slots would otherwise pay for the whole range).
  Grouped-query attention needs no repeated keys: a decode token's query heads that share a KV
  head are laid out as that KV head's "sequence" of queries.
- prefill chunks: one causal attention per chunk over its slot's cached positions plus the
  chunk itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.models.hf.kv_cache import KVCache


@dataclass(frozen=True)
class ChunkSpan:
    """One prefill chunk: tokens ``begin .. begin + length - 1`` of the packed sequence, at
    positions ``start ..`` of ``slot``. ``mask`` is None when ``start == 0`` (plain causal)."""

    slot: int
    begin: int
    length: int
    start: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class StepLayout:
    """Where every packed token goes: ``slots``/``positions`` per token (tensors), the decode
    tokens' slot range ``[lo, lo + range_size)``, their rows in it, the range's key mask
    (range_size, 1, 1, key_len; None when every row attends all ``key_len`` keys, as one
    stream does), and the prefill chunks."""

    slots: torch.Tensor
    positions: torch.Tensor
    num_decode: int
    lo: int
    range_rows: torch.Tensor | None  # None: the decode slots are exactly lo, lo+1, ... in order
    range_size: int
    gather: torch.Tensor | None  # the decode slots, when few in a wide range: attend just these
    key_len: int
    decode_mask: torch.Tensor | None
    chunks: list[ChunkSpan]

    @staticmethod
    def build(
        decode_slots: list[int],
        decode_positions: list[int],
        chunks: list[tuple[int, int, int]],
        device: torch.device,
    ) -> StepLayout:
        """``decode_positions[i]`` is the position of ``decode_slots[i]``'s token; ``chunks``
        holds (slot, start, length) per prefill chunk, packed after the decode tokens."""
        slots = list(decode_slots)
        positions = list(decode_positions)
        spans = []
        for slot, start, length in chunks:
            mask = _chunk_mask(start, length, device)
            spans.append(ChunkSpan(slot, len(slots), length, start, mask))
            slots.extend([slot] * length)
            positions.extend(range(start, start + length))
        lo, size, rows, key_len, mask, gather = 0, 0, None, 0, None, None
        if decode_slots:
            lo = min(decode_slots)
            size = max(decode_slots) - lo + 1
            key_len = max(decode_positions) + 1
            if 2 * len(decode_slots) <= size:  # sparse: copying their keys beats the range
                gather = torch.tensor(decode_slots, device=device)
                lo, size = 0, len(decode_slots)
                lengths = [position + 1 for position in decode_positions]
            else:
                lengths = [1] * size  # a dummy row attends position 0 only (never all-masked)
                for slot, position in zip(decode_slots, decode_positions, strict=True):
                    lengths[slot - lo] = position + 1
                if decode_slots != list(range(lo, lo + size)):
                    rows = torch.tensor([s - lo for s in decode_slots], device=device)
            if any(length != key_len for length in lengths):  # else every key is attended
                mask = torch.arange(key_len) < torch.tensor(lengths)[:, None]
                mask = mask.to(device).view(size, 1, 1, key_len)
        return StepLayout(
            slots=torch.tensor(slots, device=device),
            positions=torch.tensor(positions, device=device),
            num_decode=len(decode_slots),
            lo=lo,
            range_rows=rows,
            range_size=size,
            gather=gather,
            key_len=key_len,
            decode_mask=mask,
            chunks=spans,
        )


def _chunk_mask(start: int, length: int, device: torch.device) -> torch.Tensor | None:
    if start == 0:
        return None
    keys = torch.arange(start + length)
    return (keys[None, :] <= (torch.arange(length) + start)[:, None]).to(device)


def attend(cache: KVCache, layer: int, queries: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """Attention of every packed token's ``queries`` (tokens, heads, head_dim) over its slot's
    cached keys and values (the step's own keys already written). Returns (tokens, heads *
    head_dim)."""
    tokens, heads, head_dim = queries.shape
    decode = layout.num_decode
    if decode == tokens:  # decode tokens only: no packed output to assemble
        return _attend_decode(cache, layer, queries, layout).reshape(tokens, heads * head_dim)
    out = queries.new_empty(queries.shape)
    if decode:
        out[:decode] = _attend_decode(cache, layer, queries[:decode], layout)
    keys, values = cache.keys[layer], cache.values[layer]
    for chunk in layout.chunks:
        end = chunk.start + chunk.length
        q = queries[chunk.begin : chunk.begin + chunk.length].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q,
            keys[chunk.slot, :, :end],
            values[chunk.slot, :, :end],
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            enable_gqa=True,
        )
        out[chunk.begin : chunk.begin + chunk.length] = o.transpose(0, 1)
    return out.view(tokens, heads * head_dim)


def _attend_decode(
    cache: KVCache, layer: int, queries: torch.Tensor, layout: StepLayout
) -> torch.Tensor:
    batch, heads, head_dim = queries.shape
    kv_heads = cache.keys.shape[2]
    grouped = queries.view(batch, kv_heads, heads // kv_heads, head_dim)
    if layout.range_rows is not None:
        spread = grouped.new_zeros(layout.range_size, *grouped.shape[1:])
        spread[layout.range_rows] = grouped
        grouped = spread
    if layout.gather is None:
        hi = layout.lo + layout.range_size
        keys = cache.keys[layer, layout.lo : hi, :, : layout.key_len]
        values = cache.values[layer, layout.lo : hi, :, : layout.key_len]
    else:
        keys = cache.keys[layer, :, :, : layout.key_len].index_select(0, layout.gather)
        values = cache.values[layer, :, :, : layout.key_len].index_select(0, layout.gather)
    o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=layout.decode_mask)
    if layout.range_rows is not None:
        o = o[layout.range_rows]
    return o.reshape(batch, heads, head_dim)
