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
(a real model does) and every call runs in the engine's worker thread. A model may also promise
``returns_int_tokens = True`` (see ``returns_int_tokens``).

The step's simulated duration (the mock's GPU-like latency) is the engine's step clock, not the
model's: a model computes and returns as fast as it can.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
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
    # Logits processors (app/models/hf/logits_processors.py), all off by default. Penalties as
    # OpenAI and vLLM define them: frequency and presence over the generated tokens,
    # repetition (divides a positive logit, multiplies a negative one) over prompt + output.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # no stop token nor stop string ends the request before this many
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    allowed_token_ids: tuple[int, ...] | None = None  # sample only among these
    # Log probabilities: of each sampled token plus this many most likely alternatives (0:
    # the sampled token's only); of each prompt token after the first, plus alternatives.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # derived once (the engine reads it for every row of a changed batch)
    plain: bool = field(default=True, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """``plain``: no processor, no log probabilities: the model only samples."""
        plain = not self.processes_logits and self.logprobs is None and self.prompt_logprobs is None
        object.__setattr__(self, "plain", plain)

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor applies to this request (penalties, bias, bans, ...)."""
        return self.penalizes or bool(self.logit_bias) or self.constrains_choice

    @property
    def penalizes(self) -> bool:
        """Whether a frequency, presence or repetition penalty applies."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def constrains_choice(self) -> bool:
        """Whether some tokens may be forbidden (what the mocks obey): a min_tokens stop ban,
        a bias of -100 or below, bad words, an allow-list."""
        return (
            self.min_tokens > 0
            or any(bias <= BAN_BIAS for _, bias in self.logit_bias)
            or bool(self.bad_words)
            or self.allowed_token_ids is not None
        )


BAN_BIAS = -100.0  # a logit_bias at or below this bans its token (OpenAI: -100)
# What a model returns for a row whose every token is forbidden (its bans, allow-list and mask
# leave nothing to sample): the engine fails that request alone.
NO_TOKEN = -1
DEFAULT_SAMPLING = SamplingParams()
GREEDY = SamplingParams(temperature=0.0)


class TokenHistory(Protocol):
    """One request's tokens as a model may read them to sample (penalties, ``min_tokens``,
    bad words): ``tokens`` is the prompt followed by every generated token, a live list the
    engine appends to between steps (read it, never modify or keep it); ``stop_token_ids`` are
    the ids that would end it. The engine's ``Sequence`` is one, handed over as is (no copy)."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def prompt_len(self) -> int: ...

    @property
    def stop_token_ids(self) -> frozenset[int]: ...


class SampledRow(TokenHistory, Protocol):
    """A row a stateless model samples with its request's parameters (``next_tokens_for``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def sampling(self) -> SamplingParams: ...


@dataclass(frozen=True, slots=True)
class Logprobs:
    """The log-probability of one token (sampled, or a prompt token) and the ``top`` most
    likely tokens at its position, most likely first, as (token id, log-probability).
    ``rank``: the token's place in the vocabulary by probability (1: the most likely; None:
    not computed), vLLM's ``rank`` of a prompt log-probability."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a model returns instead of a plain token list when a row asked for log
    probabilities. ``tokens`` as for a list; ``logprobs[i]`` belongs to ``tokens[i]`` (None for
    a row that did not ask). ``prompt_logprobs`` maps a request id to ``(position, entries)``:
    the log-probabilities of that request's prompt tokens at ``position``, ``position + 1``,
    ... (each given the tokens before it), for the prompt positions this step computed."""

    tokens: list[int]
    logprobs: list[Logprobs | None] | None = None
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] | None = None


@dataclass(slots=True)  # (not frozen: a frozen one costs a microsecond to build)
class PrefillChunk:
    """Prompt tokens (or, for a resumed request, prompt + already generated tokens) that one
    slot processes in this step.

    ``token_ids`` sit at positions ``start .. start + len(token_ids) - 1`` of the request; the
    slot's cache holds exactly the positions before ``start`` (``start == 0``: the cache starts
    empty), except on a prefix-cache hit: then ``prefix`` holds the tokens at positions
    ``0 .. start - 1``, the slot was released (its cache is empty), and the model must put the
    prefix's key/values in the slot before processing ``token_ids`` (a mock copies the tokens;
    a real runner maps the cached blocks, which the engine's prefix cache guarantees it
    computed). Only a model with ``supports_prefix_caching = True`` ever gets a prefix, with
    one exception: a *fork* (one of a request's ``n`` choices starting from another choice's
    prompt, computed once) carries ``prefix_slot``, the slot of a running request whose cache
    holds the same ``prefix`` at positions ``0 .. start - 1``; the model copies those positions
    into ``slot`` before this step's forward (nothing in the step has changed them yet). Only a
    model with ``copies_slots = True`` ever gets a fork.
    ``sample`` is True when the chunk completes the prefill: the model then returns one
    token for this entry, sampled from the logits at the chunk's last position; a partial chunk
    returns nothing. With ``sampling.prompt_logprobs`` set, the model also returns (in a
    ``StepResult``) the log-probabilities of the prompt tokens at positions ``start + 1`` up to
    ``start + len(token_ids)`` that lie before ``history.prompt_len`` (each given the tokens
    before it; the engine skips the prefix cache for such requests). ``request_id`` identifies
    the request (for per-request sampling state such
    as a seeded generator; it changes whenever the slot is reused).
    """

    slot: int
    token_ids: list[int]
    start: int
    sample: bool
    sampling: SamplingParams
    request_id: str
    prefix: Seq[int] = ()
    history: TokenHistory | None = None  # the request's tokens (see ``TokenHistory``)
    prefix_slot: int | None = None  # a fork: the running slot that holds ``prefix``

    @property
    def fresh(self) -> bool:
        """The slot's cache starts empty in this step (then filled with ``prefix``, if any)."""
        return self.start == len(self.prefix)

    @property
    def prompt_logprob_count(self) -> int:
        """How many prompt log-probabilities this chunk yields (0 unless its request asked for
        them): those of the prompt tokens at ``start + 1`` onwards, up to the prompt's last
        token, as the row at position p predicts the token at p + 1."""
        history = self.history
        if self.sampling.prompt_logprobs is None or history is None:
            return 0
        return max(min(len(self.token_ids), history.prompt_len - 1 - self.start), 0)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step's work for a cached model.

    ``decode_slots[i]`` is fed the single token ``decode_tokens[i]``, at the position equal to
    the number of tokens its cache holds; the model appends it to the cache and samples the next
    token with ``decode_sampling[i]``. ``decode_request_ids[i]`` names the request in that slot.
    ``prefills`` are the prefill chunks of this step (their slots never also appear in
    ``decode_slots``). ``decode_histories[i]`` is the request's token history (the engine always
    gives it; a hand-built batch may leave it empty when no row processes logits). The decode
    lists may be shared with the engine between steps: never modify them.

    The model returns ``len(decode_slots) + number of prefills with sample=True`` token ids:
    first one per decode slot, in order, then one per sampling prefill chunk, in order.

    ``token_masks`` (only for a model with ``applies_token_masks = True``; empty when no row is
    constrained) has one entry per output row, in that order: None, or the bitmask of the tokens
    the row may sample (bit t = byte t // 8, bit t % 8; bits past the vocabulary are clear).
    The model must sample each masked row among its allowed tokens.
    """

    decode_slots: Seq[int]
    decode_tokens: Seq[int]
    decode_sampling: Seq[SamplingParams]
    decode_request_ids: Seq[str]
    prefills: Seq[PrefillChunk]
    decode_histories: Seq[TokenHistory] = ()  # per decode slot, when the engine gives them
    token_masks: Seq[bytes | None] = ()

    @property
    def num_outputs(self) -> int:
        return len(self.decode_slots) + sum(1 for chunk in self.prefills if chunk.sample)


@runtime_checkable
class StatelessModel(Protocol):
    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        """``batch[i]`` is one sequence's whole prefix (prompt + generated so far). Returns one
        next token per entry, in the same order. Must not modify the lists it is given.

        A stateless model may also define ``next_tokens_for(rows: Sequence[SampledRow]) ->
        list[int] | StepResult``: the engine then calls it instead whenever a row's sampling is
        not ``plain`` (a row whose ``tokens`` are exactly its prompt completes its first
        prefill: its prompt log-probabilities go there, keyed by ``request_id``)."""
        ...


@runtime_checkable
class CachedModel(Protocol):
    def step(self, batch: StepBatch) -> list[int]:
        """Process ``batch`` in one batched call and return the sampled tokens (see
        ``StepBatch`` for the order). On an exception the engine ends exactly the requests of
        this batch and releases their slots; the model must still accept ``release`` for them.

        A cached model may also define ``step_sampled(batch) -> StepResult``: the engine then
        calls it instead whenever a row's sampling is not ``plain`` (logits processors, log
        probabilities), so ``step`` stays the fast path."""
        ...

    def release(self, slot: int) -> None:
        """The request in ``slot`` ended or was preempted: drop its cache so the slot can be
        reused (a later chunk with ``start == 0`` on this slot must see an empty cache)."""
        ...


def supports_prefix_caching(model: object) -> bool:
    """Whether ``model`` takes prefill chunks that start after a cached ``prefix`` (an optional
    class attribute ``supports_prefix_caching = True``). A stateless model always does: it is
    fed each sequence's whole prefix anyway."""
    return _declares(model, "supports_prefix_caching")


def shares_prompts(model: object) -> bool:
    """Whether ``model`` can start a request from another slot's prompt cache (a fork: see
    ``PrefillChunk.prefix_slot``), so ``n`` choices prefill their prompt once. A stateless
    model can (it is fed whole prefixes); a cached model must declare ``copies_slots = True``
    (it copies the key/values between slots: a fork's prefix ends mid-block, so no prefix
    cache holds all of it)."""
    return _declares(model, "copies_slots")


def _declares(model: object, attribute: str) -> bool:
    """For a cached model, whether its class sets the optional ``attribute`` to True; a
    stateless model can do what these attributes declare."""
    if isinstance(model, CachedModel):
        return getattr(model, attribute, False) is True
    return isinstance(model, StatelessModel)


def applies_token_masks(model: object) -> bool:
    """Whether ``model`` samples under ``StepBatch.token_masks`` (an optional class attribute
    ``applies_token_masks = True``). For any other model the engine's runner makes the model's
    token obey the request's grammar (``TokenConstraint.choose``)."""
    return getattr(model, "applies_token_masks", False) is True


def returns_int_tokens(model: object) -> bool:
    """Whether ``model`` promises that every token it returns is a Python ``int`` (a class
    attribute ``returns_int_tokens = True``: the built-in models, whose tokens are ints by
    construction). The runner then checks only how many came back; any other model's tokens
    are also type-checked, one by one. The promise covers the token methods of the class that
    makes it: a subclass that redefines one without promising again is checked."""
    for cls in type(model).__mro__:
        own = vars(cls)
        if "returns_int_tokens" in own:
            return own["returns_int_tokens"] is True
        if any(name in own for name in _TOKEN_METHODS):
            return False
    return False


_TOKEN_METHODS = ("next_tokens", "next_tokens_for", "step", "step_sampled")


Model = StatelessModel | CachedModel
