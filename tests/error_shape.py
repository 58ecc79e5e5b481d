"""Reading error answers in vLLM's shape (app/api/errors.py) in tests."""

from __future__ import annotations

from typing import Any


def field_of(error: Any) -> str | None:
    """The field an error answer's ``param`` names, without the ``body.`` that vLLM's shape puts
    before it on a body failing its schema; checks that only such an error (``type`` ``Bad
    Request``) has it."""
    assert isinstance(error, dict), error
    param = error.get("param")
    if param is None:
        return None
    assert isinstance(param, str) and param.startswith("body") == (
        error.get("type") == "Bad Request"
    ), error
    return param.removeprefix("body.")
