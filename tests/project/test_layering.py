"""The layering the architecture promises: HTTP statuses are decided in app/api only, so nothing
below it imports from it (the engine, the models, serving, metrics, config)."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
ABOVE_THE_API = {"cli.py", "__main__.py", "server.py"}  # entry points: build and run the app


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_nothing_below_the_api_imports_from_it() -> None:
    offenders = {
        str(path.relative_to(APP)): sorted(
            m for m in imported_modules(path) if m.startswith("app.api")
        )
        for path in APP.rglob("*.py")
        if "api" not in path.relative_to(APP).parts and path.name not in ABOVE_THE_API
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_engine_and_models_do_not_import_serving_or_http_libraries() -> None:
    forbidden = ("app.serving", "fastapi", "starlette", "sse_starlette", "uvicorn")
    for package in ("engine", "models"):
        for path in (APP / package).rglob("*.py"):
            bad = [m for m in imported_modules(path) if m.startswith(forbidden)]
            assert bad == [], f"{path.relative_to(APP)} imports {bad}"
