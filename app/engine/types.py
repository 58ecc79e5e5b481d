"""Value types shared by the scheduler, the synchronous ``generate()`` and the async engine.

``Request`` is the seed's request, exactly. ``Sequence`` is the scheduler's live record of one
request: its token list (prompt followed by the tokens generated so far, appended in place so a
step never rebuilds a prefix), its status, how many of its tokens the model has processed, its
slot, its stop rules, its sampling parameters and its timestamps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Protocol

from app.models.protocol import DEFAULT_SAMPLING, Logprobs, SamplingParams

if TYPE_CHECKING:
    from app.engine.prefix_cache import PrefixState


@dataclass
class Request:
    """The seed's request: ``max_tokens`` counts generated tokens only, never the prompt."""

    request_id: str
    prompt: list[int]
    max_tokens: int


class FinishReason(StrEnum):
    """Why a request ended. The string values are part of the external API."""

    STOP = "stop"  # the model produced one of the request's stop tokens
    LENGTH = "length"  # max_tokens generated tokens
    ABORT = "abort"  # cancelled by the client, the operator or shutdown
    ERROR = "error"  # a model call that included this request failed


# The reasons the scheduler's step gives, as module globals (see the statuses below)
REASON_STOP, REASON_LENGTH = FinishReason.STOP, FinishReason.LENGTH


class RequestStatus(IntEnum):
    """Where a request is. Ordered: a status >= ``FINISHED`` means it has ended (its
    ``finish_reason`` says why). Only the scheduler changes it."""

    WAITING = 0  # queued, never admitted
    RUNNING = 1  # holds a slot: prefilling (possibly over several steps) or decoding
    PREEMPTED = 2  # was running, gave its slot back, queued to be recomputed and resumed
    FINISHED = 3


# The statuses as plain module globals, for the hot paths (the scheduler's step, the properties
# below): on CPython 3.11 every ``RequestStatus.RUNNING`` is looked up through
# ``EnumType.__getattr__``, about a thousand machine instructions; a global costs a few.
WAITING, RUNNING, PREEMPTED, FINISHED = (
    RequestStatus.WAITING,
    RequestStatus.RUNNING,
    RequestStatus.PREEMPTED,
    RequestStatus.FINISHED,
)


class StopCondition(Protocol):
    """A stop rule beyond stop token ids (stop strings): fed each step's new tokens, it says
    whether the request must end now. Runs in the engine's output path, so a request ends at the
    step that completes its stop string whatever its reader's pace."""

    def feed(self, tokens: list[int]) -> bool: ...


class TokenConstraint(Protocol):
    """A request's output grammar (structured outputs, tool calls): which tokens may come next.
    Implemented by ``app.structured.grammar.GrammarMatcher``. The runner reads it before a
    model call (``mask`` or ``choose``) and the scheduler advances it with each accepted token
    (``accept``); it has then consumed exactly the request's generated tokens, so a preempted
    request resumes with it as it was (nothing is replayed). Dropped when the request ends."""

    def mask(self) -> bytes:
        """The allowed next tokens: bit t (byte t // 8, bit t % 8) set for an allowed token t."""
        ...

    def choose(self, preferred: int) -> int:
        """For a model that cannot apply a mask: ``preferred`` if allowed, else an allowed token
        (deterministic, steering toward completing the structure). The token it returns is
        still to be ``accept``-ed (or, if it is dropped, forgotten by the next call)."""
        ...

    def advance(self, token: int) -> None:
        """For a model that applied the mask: consume ``token`` now, on the model's thread, so
        that ``accept(token)`` costs nothing on the event loop."""
        ...

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar forbids it, or if the work of its
        grammar exceeded the server's budget."""
        ...

    def refusal(self, token: int) -> Exception:
        """Why ``accept(token)`` returned False: ``GrammarLimitError`` if the grammar engine gave
        up on the request's grammar (a limit on its work per token, or the CPU time its work
        may take: the client's grammar),
        else ``ModelOutputError`` (the model emitted a token its grammar forbids: a bug)."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar has ended: nothing more may be generated."""
        ...

    @property
    def stopped(self) -> bool:
        """The grammar's text is complete: only EOS may follow (then it is ``finished``)."""
        ...


@dataclass(slots=True)
class Timestamps:
    """``time.monotonic()`` readings of one request's life, for latency metrics and logs."""

    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False, slots=True)
class Sequence:
    """One request as the scheduler tracks it.

    ``tokens`` is the prefix the model reads: the prompt followed by every generated token. It is
    one list, appended to in place; ``tokens[prompt_len:]`` are the generated tokens.

    ``num_computed_tokens`` counts the tokens whose key/values the model holds for this request
    (0 unless running). ``prefill_target`` is ``len(tokens)`` when the request was last
    admitted: positions below it are prefilled (the prompt, or prompt + generated tokens
    recomputed after a preemption), in chunks, counted by ``prefilled``; the chunk that reaches
    it samples a token, and from then on the request decodes one token per step, feeding its
    last token, so it has computed every token but that one (``len(tokens) - 1``: derived, so
    the hot path writes nothing per token).
    """

    request_id: str
    tokens: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int]
    include_stop: bool = False
    priority: int = 0
    sampling: SamplingParams = DEFAULT_SAMPLING
    stop: StopCondition | None = None
    constraint: TokenConstraint | None = None  # its output grammar (None: unconstrained)
    user: str | None = None
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # n > 1: the request (another choice of the same prompt) whose prompt cache this one starts
    # from. While set, it waits in the queue until that request is past its prefill; it then
    # starts from a copy of that request's cache (a fork: its prompt is prefilled once for
    # every choice). Cleared once forked, or when forking is not possible (it prefills alone).
    fork_of: Sequence | None = field(default=None, repr=False)
    prompt_len: int = 0
    token_limit: int = 0  # len(tokens) at which max_tokens is reached
    status: RequestStatus = WAITING
    prefilled: int = 0
    prefill_target: int = 0
    num_preemptions: int = 0
    admission: int = 0  # the scheduler's admission count when it last got a slot
    # scheduling-policy state (app/engine/policies.py): times passed over while waiting or
    # preempted by a policy; when it last entered the queue; its MLFQ level and the
    # num_generated at which its current time slice started
    overtaken: int = 0
    queued_at: float = 0.0
    level: int = 0
    slice_start: int = 0
    slot: int | None = None
    prefix: PrefixState | None = None  # its prompt's blocks in the prefix cache (when enabled)
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    stop_token: int | None = None  # the stop token that ended it (STOP), if one did
    times: Timestamps = field(default_factory=Timestamps)
    # log probabilities, when asked: ``logprobs[i]`` of generated token i; ``prompt_logprobs[p]``
    # of prompt token p (None at 0, which has none), filled as the prefill runs
    logprobs: list[Logprobs | None] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    # every token goes through the full end rules (stop strings, log probabilities, bans)
    slow: bool = False
    # set by the scheduler while it decodes: below this ``len(tokens)``, a token that is no stop
    # token needs no end rule (0: every token does)
    fast_until: int = 0
    # prefill/decode disaggregation (app/kv_transfer): ``remote_decode``: a producer's request
    # whose blocks are held for a remote decoder when it ends by length (``held``: their ids,
    # set by the scheduler); ``remote_tokens``: a consumer's leading prompt tokens whose KV
    # arrived from the producer, counted as computed at its first admission (< prompt_len)
    remote_decode: bool = False
    held: tuple[int, ...] | None = None
    remote_tokens: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)
        self.token_limit = self.prompt_len + self.max_tokens
        sampling = self.sampling
        if sampling is DEFAULT_SAMPLING:  # the usual case: nothing asked beyond a token
            self.slow = self.stop is not None
            return
        if sampling.logprobs is not None:
            self.logprobs = []
        if sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        # bans (min_tokens' too) may leave the model no token to sample: it answers NO_TOKEN
        self.slow = self.stop is not None or self.logprobs is not None or sampling.constrains_choice

    @property
    def prompt_logprobs_done(self) -> bool:
        """Whether every prompt token's log-probability is known (or none was asked for)."""
        found = self.prompt_logprobs
        return found is None or len(found) >= self.prompt_len

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def generated(self) -> list[int]:
        """A copy of the generated tokens (stop token included only with ``include_stop``)."""
        return self.tokens[self.prompt_len :]

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """Running and not yet through its prefill (no token sampled since admission)."""
        return self.status is RUNNING and self.prefilled < self.prefill_target

    @property
    def awaits_fork(self) -> bool:
        """Waiting until the request it forks from (``fork_of``) is past its prefill: that one
        is queued, preempted or still prefilling."""
        source = self.fork_of
        if source is None:
            return False
        status = source.status
        waiting = status is WAITING or status is PREEMPTED
        return waiting or source.prefilling

    @property
    def num_computed_tokens(self) -> int:
        if self.status is not RUNNING:
            return 0
        if self.prefilled < self.prefill_target:
            return self.prefilled
        return len(self.tokens) - 1
