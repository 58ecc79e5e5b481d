"""A request's output stream: what ``Engine.submit()`` returns.

It is a view over the request's ``Sequence`` plus one ``asyncio.Event``, not a queue: the engine
appends tokens to the sequence and calls ``notify()``; the consumer takes every token generated
since its last read in one ``Delta``. A consumer slower than the engine therefore gets fewer,
larger deltas, and the stream holds nothing beyond the sequence itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Protocol

from app.engine.types import FinishReason, Sequence
from app.models.protocol import Logprobs


@dataclass(frozen=True, slots=True)
class Delta:
    """Tokens generated since the previous delta; the last delta has ``finish_reason`` set."""

    tokens: list[int]
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    logprobs: list[Logprobs | None] | None = None  # one per token, when the request asked


class RequestView(Protocol):
    """What the API may read of one request, read-only (the type checker refuses a write; the
    ``Sequence`` behind it stays the engine's): its id, prompt, output, how it ended."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt(self) -> list[int]: ...  # a copy
    @property
    def prompt_len(self) -> int: ...
    @property
    def num_generated(self) -> int: ...
    @property
    def generated(self) -> list[int]: ...  # a copy
    @property
    def finish_reason(self) -> FinishReason | None: ...  # None while it runs
    @property
    def error(self) -> BaseException | None: ...  # what ended it in error, if anything did
    @property
    def stop_token(self) -> int | None: ...  # the stop token that ended it, if one did
    @property
    def prompt_logprobs(self) -> Sequence_[Logprobs | None] | None: ...  # None: not asked
    @property
    def held(self) -> tuple[int, ...] | None: ...  # its blocks held for a remote decoder


class RequestStream:
    """Async iterator of ``Delta``s for one request, ending after the delta with a finish reason.
    ``view``: the request, read-only (all the API reads of it)."""

    __slots__ = ("_done", "_ended", "_event", "_read", "seq")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self._read = seq.prompt_len
        self._event = asyncio.Event()
        self._done = False
        self._ended: asyncio.Event | None = None  # made only for a caller of ended()

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def view(self) -> RequestView:
        return self.seq

    def fork_source(self) -> Sequence:
        """The request as ``Serving.prepare(fork_of=...)`` takes it (another choice of the same
        prompt may start from its prompt cache); the API hands it on without reading it."""
        return self.seq

    def notify(self) -> None:
        """Engine side: new tokens or a finish are available."""
        self._event.set()
        if self._ended is not None and self.seq.finish_reason is not None:
            self._ended.set()

    async def ended(self) -> None:
        """Return once the engine has ended the request (finished or applied an abort): its id
        is no longer live then. The engine notifies a finished stream in the same step as it
        forgets the id, so a waiter woken here finds the id free."""
        if self.seq.finish_reason is not None:
            return
        if self._ended is None:
            self._ended = asyncio.Event()
        await self._ended.wait()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        seq = self.seq
        while len(seq.tokens) == self._read and seq.finish_reason is None:
            self._event.clear()
            await self._event.wait()
        start = self._read
        tokens = seq.tokens[start:]
        self._read = start + len(tokens)
        if seq.finish_reason is not None:
            self._done = True
        if seq.logprobs is None:
            return Delta(tokens, seq.finish_reason, seq.error)
        first = start - seq.prompt_len
        logprobs = seq.logprobs[first : first + len(tokens)]
        return Delta(tokens, seq.finish_reason, seq.error, logprobs)

    async def collect(self) -> tuple[list[int], FinishReason, BaseException | None]:
        """Wait for the end; return all generated tokens, the finish reason and any error."""
        async for _ in self:
            pass
        assert self.seq.finish_reason is not None
        return self.seq.generated, self.seq.finish_reason, self.seq.error
