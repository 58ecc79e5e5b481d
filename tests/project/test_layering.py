"""The layering the architecture promises: HTTP statuses are decided in app/api only, so nothing
below it imports from it (the engine, the models, serving, metrics, config)."""

from __future__ import annotations

import ast
import re
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


# The HTTP edge: the app factory (499 for a client gone before its answer) and the uvicorn
# protocol (431, 408 and 503 written before a request reaches the app).
STATUS_DECIDERS = {"api/errors.py", "api/app.py", "api/connection.py"}


def status_codes(path: Path) -> list[str]:
    """Where ``path`` names an HTTP status: an error status number (400-599) in its code (not
    as a named bound such as ``max_length=512``), or a ``status_code=`` argument."""
    tree = ast.parse(path.read_text())
    bounds = {id(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword)}
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and type(node.value) is int
            and 400 <= node.value < 600
            and id(node) not in bounds
        ):
            found.append(f"line {node.lineno}: {node.value}")
        elif isinstance(node, ast.keyword) and node.arg == "status_code":
            found.append(f"line {node.lineno}: status_code=")
    return found


def test_status_codes_are_decided_in_the_error_map_and_the_http_edge_only() -> None:
    """Code below the routes raises typed errors (``InvalidField``, ``NotFound``, ...);
    app/api/errors.py alone turns them into status codes and each protocol's shape."""
    offenders = {
        str(path.relative_to(APP)): found
        for path in (APP / "api").rglob("*.py")
        if str(path.relative_to(APP)) not in STATUS_DECIDERS and (found := status_codes(path))
    }
    assert offenders == {}


# faults.py builds the stream of an injected failure from its Sequence (as the engine would)
SEQUENCE_READERS = {"api/faults.py"}


def test_the_api_reads_a_request_through_its_read_only_view() -> None:
    """app/api reads a request through ``RequestStream.view`` (``RequestView``), never the
    engine's live ``Sequence`` (``stream.seq``)."""
    offenders = {
        str(path.relative_to(APP)): [
            f"line {n}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.search(r"\.seq\b", line)
        ]
        for path in (APP / "api").rglob("*.py")
        if str(path.relative_to(APP)) not in SEQUENCE_READERS
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of app/ and the app modules it imports (``TYPE_CHECKING`` imports too: a
    circle drawn only for the type checker is still a circle a reader has to follow)."""
    modules = {module_name(path): path for path in APP.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:  # a submodule imported by name, else the module's own
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name and t != "app"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_in_app() -> None:
    """Issue 29: no module of app/ reaches itself through its imports (engine/prefix_cache <->
    engine/types went: the cache reads a request through its ``CachedRequest`` protocol)."""
    assert cycles(import_graph()) == []


def functions_assigning(path: Path, attribute: str) -> list[str]:
    """The functions of ``path`` with an assignment to ``<something>.<attribute>`` (as a
    target of ``=``, ``+=`` or a tuple assignment), as ``file:function``; an object setting its
    own (``self.status``, an HTTP error's) is not counted."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                targets = (
                    inner.targets if isinstance(inner, ast.Assign)
                    else [inner.target] if isinstance(inner, ast.AugAssign | ast.AnnAssign)
                    else []
                )  # fmt: skip
                for target in targets:
                    for leaf in ast.walk(target):
                        if (
                            isinstance(leaf, ast.Attribute)
                            and leaf.attr == attribute
                            and not (isinstance(leaf.value, ast.Name) and leaf.value.id == "self")
                        ):
                            found.append(f"{path.relative_to(APP)}:{node.name}")
    return sorted(set(found))


def test_a_request_status_has_one_writer() -> None:
    """Issue 29: a request's status changes in one function, the scheduler's ``set_status``;
    every other place (the scheduler's transitions, the engine's last resort, an injected
    failure) calls it."""
    for attribute in ("status", "finish_reason"):
        writers = [w for p in APP.rglob("*.py") for w in functions_assigning(p, attribute)]
        writers = [w for w in writers if not w.startswith("bench/")]  # (a client's record)
        assert writers == ["engine/scheduler.py:set_status"], attribute


CORE_INTERNALS = {"scheduler", "runner", "live", "aborting"}
# Readers of the core's internals that remain (issue 29 goal: none): the metrics' gauges read
# the slot table and KV books, and serving routes by the live requests. Owned by other work;
# this list may only shrink.
CORE_READERS = ("metrics.py", "serving")


def core_internal_uses(path: Path) -> list[str]:
    """``core.<internal>`` / ``<x>.core.<internal>`` in ``path``, as ``file:line``."""
    return [
        f"{path.relative_to(APP)}:{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in CORE_INTERNALS
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "core")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "core")
        )
    ]


def test_the_engine_drives_its_core_through_public_methods_only() -> None:
    """Issue 29: the Engine reached into ``core.scheduler``, ``core.runner`` and ``core.live``
    14 times. Only ``app/engine/core.py`` touches them (as ``self.``), and nothing new may."""
    uses = [use for path in APP.rglob("*.py") for use in core_internal_uses(path)]
    assert [use for use in uses if not use.startswith(CORE_READERS)] == []
