"""Errors the engine raises. ``ValueError`` is kept for the caller's bad input; model faults and
engine states have their own types so the API layer can map each to one HTTP answer."""

from __future__ import annotations


class ModelError(RuntimeError):
    """A model call failed. ``partial`` holds each request's tokens generated before it."""

    def __init__(self, message: str, partial: dict[str, list[int]] | None = None) -> None:
        super().__init__(message)
        self.partial: dict[str, list[int]] = partial or {}


class ModelOutputError(ModelError):
    """The model broke its contract: wrong number of tokens, or a token that is not an integer."""


class GrammarLimitError(Exception):
    """The grammar engine gave up on a request's own grammar mid-decode: following it past this
    token would exceed one of the engine's bounds on the work per token (llguidance's limits:
    Earley items in a row or per mask, lexer fuel or states; reached by very ambiguous or
    right-recursive grammars). The client's grammar is the problem, not the model: the API
    answers it as it answers a grammar that does not compile (400 ``invalid_grammar``, or the
    stream's error event), naming the request field that set the grammar. The message is the
    grammar engine's, shortened."""


class NoTokenLeftError(Exception):
    """A request's own bans (``allowed_token_ids``, ``logit_bias`` -100, ``bad_words``, the stop
    tokens before ``min_tokens``), with its grammar's mask, left no token to sample mid-decode
    (the model reported ``NO_TOKEN`` for its row): the client's request is the problem, not
    the model, so the API answers it as a 400 (the stream's error event when streamed)."""


class UnsupportedFeatureError(ValueError):
    """The engine was configured with a feature its model does not implement."""


class EngineError(RuntimeError):
    """Base of the engine's refusals of a submit."""


class QueueFullError(EngineError):
    """The waiting queue holds ``max_waiting`` requests already."""

    @classmethod
    def for_bounds(cls, num_slots: int, max_waiting: int) -> QueueFullError:
        """The refusal of an engine with these bounds (one message for real and injected)."""
        return cls(
            f"all {num_slots} slots are busy and the waiting queue is full ({max_waiting} requests)"
        )


class DuplicateRequestError(EngineError):
    """A live request already has this id."""


class EngineDrainingError(EngineError):
    """The engine is stopping and admits nothing new."""

    def __init__(self, message: str = "the server is shutting down") -> None:
        super().__init__(message)


class EngineDeadError(EngineError):
    """The engine task has died; nothing can be served."""
