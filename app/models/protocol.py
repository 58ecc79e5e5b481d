"""The interfaces between the engine and a model.

Two model protocols:

- ``StatelessModel`` is the seed's: every call receives each sequence's full token prefix and
  returns one next token per entry. The model keeps no state between calls.
- ``CachedModel`` keeps a key/value cache per batch slot. Each engine step is ONE call of
  ``step(batch)``: ``batch`` says, for every slot the step touches, exactly which tokens the
  slot processes (the last generated token of a decoding request, or a chunk of a prompt being
  prefilled, possibly one of several chunks) and at which position they start. Between steps
  the engine calls ``release(slot)`` for every slot whose request ended or was preempted; a
  released slot's cache must be empty before the slot is used again, and a chunk with
  ``start == 0`` always arrives on a released (or never used) slot.

Both may set ``blocking = False`` to say their calls are quick and never wait, so the engine runs
them on the event loop instead of in a worker thread. Without it, a model is assumed to block
(a real model does) and every call runs in the engine's worker thread.

The step's simulated duration (the mock's GPU-like latency) is the engine's step clock, not the
model's: a model computes and returns as fast as it can.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its next token. Stateless and cached mocks ignore it.

    ``temperature`` None means the model's default (the checkpoint's generation config, else
    1.0); 0 means greedy (argmax). ``top_k`` 0, ``top_p`` 1.0 and ``min_p`` 0 are off
    (``min_p``: drop the tokens less likely than ``min_p`` times the most likely one). A request
    with a ``seed`` draws each token from (seed, position) alone, so it gets the same tokens
    whatever else shares its batch.
    """

    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_SAMPLING


DEFAULT_SAMPLING = SamplingParams()
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prompt tokens (or, for a resumed request, prompt + already generated tokens) that one
    slot processes in this step.

    ``token_ids`` sit at positions ``start .. start + len(token_ids) - 1`` of the request; the
    slot's cache holds exactly the positions before ``start`` (``start == 0``: the cache starts
    empty), except on a prefix-cache hit: then ``prefix`` holds the tokens at positions
    ``0 .. start - 1``, the slot was released (its cache is empty), and the model must put the
    prefix's key/values in the slot before processing ``token_ids`` (a mock copies the tokens;
    a real runner maps the cached blocks, which the engine's prefix cache guarantees it
    computed). Only a model with ``supports_prefix_caching = True`` ever gets a prefix.
    ``sample`` is True when the chunk completes the prefill: the model then returns one
    token for this entry, sampled from the logits at the chunk's last position; a partial chunk
    returns nothing. ``request_id`` identifies the request (for per-request sampling state such
    as a seeded generator; it changes whenever the slot is reused).
    """

    slot: int
    token_ids: list[int]
    start: int
    sample: bool
    sampling: SamplingParams
    request_id: str
    prefix: Seq[int] = ()

    @property
    def fresh(self) -> bool:
        """The slot's cache starts empty in this step (then filled with ``prefix``, if any)."""
        return self.start == len(self.prefix)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step's work for a cached model.

    ``decode_slots[i]`` is fed the single token ``decode_tokens[i]``, at the position equal to
    the number of tokens its cache holds; the model appends it to the cache and samples the next
    token with ``decode_sampling[i]``. ``decode_request_ids[i]`` names the request in that slot.
    ``prefills`` are the prefill chunks of this step (their slots never also appear in
    ``decode_slots``). The decode lists may be shared with the engine between steps: never
    modify them.

    The model returns ``len(decode_slots) + number of prefills with sample=True`` token ids:
    first one per decode slot, in order, then one per sampling prefill chunk, in order.
    """

    decode_slots: Seq[int]
    decode_tokens: Seq[int]
    decode_sampling: Seq[SamplingParams]
    decode_request_ids: Seq[str]
    prefills: Seq[PrefillChunk]

    @property
    def num_outputs(self) -> int:
        return len(self.decode_slots) + sum(1 for chunk in self.prefills if chunk.sample)

    @property
    def num_tokens(self) -> int:
        """Tokens processed in this step (decode tokens + prefill chunk tokens)."""
        return len(self.decode_slots) + sum(len(chunk.token_ids) for chunk in self.prefills)


@runtime_checkable
class StatelessModel(Protocol):
    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        """``batch[i]`` is one sequence's whole prefix (prompt + generated so far). Returns one
        next token per entry, in the same order. Must not modify the lists it is given."""
        ...


@runtime_checkable
class CachedModel(Protocol):
    def step(self, batch: StepBatch) -> list[int]:
        """Process ``batch`` in one batched call and return the sampled tokens (see
        ``StepBatch`` for the order). On an exception the engine ends exactly the requests of
        this batch and releases their slots; the model must still accept ``release`` for them."""
        ...

    def release(self, slot: int) -> None:
        """The request in ``slot`` ended or was preempted: drop its cache so the slot can be
        reused (a later chunk with ``start == 0`` on this slot must see an empty cache)."""
        ...


def supports_prefix_caching(model: object) -> bool:
    """Whether ``model`` takes prefill chunks that start after a cached ``prefix`` (an optional
    class attribute ``supports_prefix_caching = True``). A stateless model always does: it is
    fed each sequence's whole prefix anyway."""
    if isinstance(model, CachedModel):
        return getattr(model, "supports_prefix_caching", False) is True
    return isinstance(model, StatelessModel)


Model = StatelessModel | CachedModel
