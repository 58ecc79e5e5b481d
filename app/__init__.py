"""slotserve: a continuous-batching LLM inference server.

``from app import Request, generate, MockModel`` gives the seed's interface.
"""

from app.engine.errors import ModelError, ModelOutputError
from app.engine.generate import generate
from app.engine.types import FinishReason, Request
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel

__all__ = [
    "CachedMockModel",
    "FinishReason",
    "MockModel",
    "ModelError",
    "ModelOutputError",
    "Request",
    "generate",
]
