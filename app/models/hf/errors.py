"""The one error a real model raises when it cannot be loaded."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be loaded. The message is one line a user can act on (which command
    installs what is missing, which path is wrong, which architecture is not supported)."""
