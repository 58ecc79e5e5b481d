"""Reading error answers in vLLM's shape (app/api/errors.py) in tests."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import httpx

PARAM_HEADER = "x-slotserve-error-param"  # our precise field, whatever the body's param shows


def field_of(answer: Any) -> str | None:
    """The field an error answer names. Of a response: the ``X-Slotserve-Error-Param`` header
    (the field as precisely as the server knows it; the body's ``param`` may be null where
    vLLM's is). Of an error body: its ``param``, without the ``body.`` that vLLM's shape puts
    before it on a body failing its schema; checks that only such an error (``type`` ``Bad
    Request``) has it."""
    if isinstance(answer, httpx.Response):
        field_of(answer.json()["error"])  # the body's shape holds too
        field = answer.headers.get(PARAM_HEADER)  # percent-encoded past ASCII names
        return None if field is None else unquote(field)
    error = answer
    assert isinstance(error, dict), error
    param = error.get("param")
    if param is None:
        return None
    assert isinstance(param, str) and param.startswith("body") == (
        error.get("type") == "Bad Request"
    ), error
    return param.removeprefix("body.")
