"""Value types shared by the scheduler, the synchronous ``generate()`` and the async engine.

``Request`` is the seed's request, exactly. ``Sequence`` is the scheduler's live record of one
request: its token list (prompt followed by the tokens generated so far, appended in place so a
step never rebuilds a prefix), its slot, its stop rule and its timestamps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum


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
    """

    request_id: str
    tokens: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int]
    include_stop: bool = False
    priority: int = 0
    prompt_len: int = 0
    token_limit: int = 0  # len(tokens) at which max_tokens is reached
    slot: int | None = None
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    times: Timestamps = field(default_factory=Timestamps)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)
        self.token_limit = self.prompt_len + self.max_tokens

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
