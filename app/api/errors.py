"""One error shape everywhere: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's).

A client's mistake is a 4xx with a message saying what is wrong; only our own faults are 5xx.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("slotserve.api")

INVALID = "invalid_request_error"


class APIError(Exception):
    """An error answer: raised anywhere in a handler, rendered by the installed handler."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_json(status: int, message: str, type: str, code: str | None = None) -> bytes:
    return json.dumps(error_body(message, type, None, code)).encode()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        param = None
        message = f"request body is not valid JSON: {first.get('msg', '')}"
    elif not loc and first.get("type") in ("model_attributes_type", "missing"):
        message = "request body must be a JSON object (send Content-Type: application/json)"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
    return JSONResponse(error_body(message, INVALID, param, first.get("type")), status_code=400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "not_found_error" if exc.status_code == 404 else INVALID
    return JSONResponse(
        error_body(str(exc.detail), kind, None, None),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(
        error_body("internal server error", "server_error", None, "internal_error"),
        status_code=500,
    )
