"""The installed package's version, for ``slotserve --version`` and the OpenAPI document."""

from __future__ import annotations

import importlib.metadata


def version() -> str:
    """``pyproject.toml``'s version as installed (``unknown`` for a tree never installed)."""
    try:
        return importlib.metadata.version("slotserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
