"""Where the deployment files live, and the nginx renderer they share with the tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"


def load_renderer() -> ModuleType:
    """``docker/render_nginx.py``, the one renderer of the nginx template (it is a script, not
    part of the ``app`` package)."""
    spec = importlib.util.spec_from_file_location("render_nginx", DOCKER / "render_nginx.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
