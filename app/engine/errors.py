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


class EngineError(RuntimeError):
    """Base of the engine's refusals of a submit."""


class QueueFullError(EngineError):
    """The waiting queue holds ``max_waiting`` requests already."""


class DuplicateRequestError(EngineError):
    """A live request already has this id."""


class EngineDrainingError(EngineError):
    """The engine is stopping and admits nothing new."""


class EngineDeadError(EngineError):
    """The engine task has died; nothing can be served."""
