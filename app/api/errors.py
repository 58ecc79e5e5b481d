"""One error shape everywhere: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's).

A client's mistake is a 4xx with a message saying what is wrong; only our own faults are 5xx.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.engine.errors import (
    DuplicateRequestError,
    EngineDrainingError,
    EngineError,
    GrammarLimitError,
    QueueFullError,
)
from app.serving import (
    InvalidRequestError,
    ModelLoadFailedError,
    ModelLoadingError,
    NotReadyError,
    context_length_error,
)

log = logging.getLogger("slotserve.api")

INVALID = "invalid_request_error"


# the error answers of the generation routes (OpenAPI's ``responses``)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "invalid request"},
    401: {"description": "missing or invalid API key"},
    409: {"description": "a live request already has this request_id"},
    413: {"description": "body too large"},
    429: {"description": "waiting queue full (see Retry-After)"},
    503: {"description": "draining or engine dead"},
}


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
    app.add_exception_handler(InvalidRequestError, _refused)
    app.add_exception_handler(EngineError, _refused)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


def response_for(err: APIError) -> JSONResponse:
    """The HTTP response of ``err`` (handlers and pure-ASGI middleware answer alike)."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return response_for(exc)


async def _refused(request: Request, exc: Exception) -> JSONResponse:
    """A request refused below the API: its HTTP answer is decided here."""
    if isinstance(exc, InvalidRequestError):
        return await _api_error(request, invalid_request(exc))
    assert isinstance(exc, EngineError)
    return await _api_error(request, refusal(exc))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)  # the API key was checked before (auth)
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        message = f"request body is not valid JSON: {first.get('msg', '')}"
        return JSONResponse(error_body(message, INVALID, None, "json_invalid"), status_code=400)
    chosen, param, problem = _problem(errors)
    code = chosen.get("type")
    if param is None and code in ("model_attributes_type", "missing"):
        message = "request body must be a JSON object (send Content-Type: application/json)"
        return JSONResponse(error_body(message, INVALID, None, code), status_code=400)
    message = f"{param or 'body'}: {problem}"
    others = {_field(e) for e in errors} - {_field(chosen)}
    if others:
        message += f" (and {len(others)} more field(s) with problems)"
    return JSONResponse(error_body(message, INVALID, param, code), status_code=400)


_UNION_MEMBER = re.compile(r"[\[\](), -]|^(str|int|float|bool|list|dict|none)$")


def _param(loc: Sequence[object]) -> str | None:
    """The field's dotted path, without "body" and without the tags pydantic adds for the
    member of a union that was tried (``prompt.list[constrained-int].0`` -> ``prompt.0``). The
    top-level field is kept whatever its name: it may be a client's unknown key."""
    parts = [part for part in loc if part != "body"]
    kept = [str(part) for part in parts[:1]] + [
        str(part)
        for part in parts[1:]
        if not (isinstance(part, str) and _UNION_MEMBER.search(part))
    ]
    return ".".join(kept) or None


def _field(error: dict[str, Any]) -> object:
    """The top-level body field an error is about (a union's members share it)."""
    return next((part for part in error.get("loc", ()) if part != "body"), None)


def _problem(errors: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], str | None, str]:
    """The error, field and message to report. A union field gets one error per member it tried.
    One that is not a type mismatch says most: a member matched, but the value is wrong. When
    all are type mismatches, the deepest one says most (the outer types matched), and the
    message lists every type accepted there."""
    if not errors:
        return {}, None, "invalid value"
    located = [(error, _param(error.get("loc", ()))) for error in errors]
    specific = [(e, p) for e, p in located if not str(e.get("type", "")).endswith("_type")]
    if specific:
        chosen, param = specific[0]
        return chosen, param, str(chosen.get("msg", "invalid value"))
    chosen, param = max(located, key=lambda pair: len((pair[1] or "").split(".")))
    kinds = dict.fromkeys(
        str(e.get("msg", "")).removeprefix("Input should be ") for e, p in located if p == param
    )
    return chosen, param, "Input should be " + " or ".join(kinds)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError | RecursionError):
        # FastAPI's answer to a body json.loads cannot even start on (invalid UTF-8) or gives
        # up on (nested past Python's recursion limit): still a JSON error, so say so
        what = "not UTF-8" if isinstance(exc.__cause__, UnicodeDecodeError) else "nested too deep"
        message = f"request body is not valid JSON: {what}"
        return JSONResponse(error_body(message, INVALID, None, "json_invalid"), status_code=400)
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


# The errors a failure can be injected as (app/api/faults.py) are built here, by the functions
# that build the real ones, so an injected failure cannot drift from the real one.

RETRY_AFTER = "1"  # seconds, on 429 (queue full) and 503 (draining, engine dead)


def refusal(err: EngineError) -> APIError:
    """The answer to a submit the engine refused: 429 queue full, 409 duplicate id, 503
    draining or engine dead. 429 and 503 carry ``Retry-After``."""
    retry = {"Retry-After": RETRY_AFTER}
    if isinstance(err, QueueFullError):
        return APIError(429, str(err), "overloaded_error", code="queue_full", headers=retry)
    if isinstance(err, DuplicateRequestError):
        return APIError(409, str(err), param="request_id", code="duplicate_request_id")
    if isinstance(err, ModelLoadFailedError):  # permanent: no Retry-After
        return APIError(503, str(err), "service_unavailable", code="load_failed")
    if isinstance(err, ModelLoadingError):
        return APIError(503, str(err), "service_unavailable", code="loading", headers=retry)
    if isinstance(err, NotReadyError):  # asleep, or within --startup-delay
        return APIError(503, str(err), "service_unavailable", code=err.code, headers=retry)
    code = "draining" if isinstance(err, EngineDrainingError) else "engine_dead"
    return APIError(503, str(err), "service_unavailable", code=code, headers=retry)


def invalid_api_key() -> APIError:
    """401 for a missing or wrong ``Authorization: Bearer <key>`` (or ``x-api-key``)."""
    return APIError(401, "missing or invalid API key (Authorization: Bearer <key> or x-api-key)",
                    "authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})  # fmt: skip


def not_serving(state: str) -> APIError:
    """503 while the server does not serve (``state`` says why: draining, engine_dead, ...)."""
    return APIError(503, f"not serving: {state}", "service_unavailable", code=state)


def too_many_watchers(limit: int) -> APIError:
    """503 for a dashboard stream past the open streams' bound (one may close: retry)."""
    return APIError(503, f"at most {limit} dashboards may watch at once", "service_unavailable",
                    code="too_many_watchers", headers={"Retry-After": RETRY_AFTER})  # fmt: skip


def invalid_request(err: InvalidRequestError) -> APIError:
    """400 for a request the model cannot take (``app.serving`` says why and which field)."""
    return APIError(400, str(err), param=err.param, code=err.code)


def context_length_exceeded(prompt_len: int, max_tokens: int, context: int) -> APIError:
    """400 for a prompt plus ``max_tokens`` that does not fit in the context length."""
    return invalid_request(context_length_error(prompt_len, max_tokens, context))


def model_not_found(requested: str, served: str) -> APIError:
    """404 for an OpenAI ``model`` that this server does not serve."""
    return APIError(404, f"model {requested!r} does not exist; this server serves {served!r}",
                    "not_found_error", param="model", code="model_not_found")  # fmt: skip


def model_failed_message(error: BaseException | None) -> str:
    """The message of a request that a failed model call ended (HTTP 500 or an error event)."""
    return f"model call failed: {error!r}"


def generation_failed(error: BaseException | None, grammar_param: str | None) -> APIError:
    """The answer to a request that ended in error mid-generation: 400 ``invalid_grammar``
    naming ``grammar_param`` (the field that set the request's grammar) when the grammar engine
    gave up on that grammar (``GrammarLimitError``: the client's grammar is the problem), else
    500 ``model_error`` (a failed model call, or a model that broke its contract)."""
    if isinstance(error, GrammarLimitError):
        param = grammar_param or "response_format"
        message = f"{param}: the grammar engine gave up on this grammar mid-generation: {error}"
        return APIError(400, message, param=param, code="invalid_grammar")
    return APIError(500, model_failed_message(error), "server_error", code="model_error")
