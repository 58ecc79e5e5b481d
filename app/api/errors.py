"""One error shape everywhere: vLLM's ``{"error": {"message", "type", "param", "code"}}``, where
``type`` names the kind of failure as vLLM does (``BadRequestError``, ``NotFoundError`` ...; ``Bad
Request`` for a body that fails its schema) and ``code`` repeats the HTTP status. Our own code
naming the problem (``context_length_exceeded``, ``queue_full`` ...) rides in the
``X-Slotserve-Error-Code`` header, where vLLM-shaped clients do not look (docs/api.md, Errors);
the field it is about, as precisely as we know it, in ``X-Slotserve-Error-Param`` (the body's
``param`` is what vLLM shows there: null where vLLM's own check leaves it null).

A client's mistake is a 4xx with a message saying what is wrong; only our own faults are 5xx.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.engine.errors import (
    DuplicateRequestError,
    EngineDrainingError,
    EngineError,
    GrammarLimitError,
    NoTokenLeftError,
    QueueFullError,
)
from app.serving import (
    InvalidRequestError,
    ModelLoadFailedError,
    ModelLoadingError,
    NotReadyError,
)

log = logging.getLogger("slotserve.api")

ERROR_CODE_HEADER = "X-Slotserve-Error-Code"  # our code naming the problem (not in the body)
ERROR_PARAM_HEADER = "X-Slotserve-Error-Param"  # the field, precisely (the body's may be null)
SCHEMA_ERROR = "Bad Request"  # vLLM's type for a body that fails its schema

# vLLM's error ``type`` of each status (the openai SDK's exception names, as vLLM sends them)
ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
    404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
    409: "ConflictError", 413: "RequestTooLargeError", 422: "UnprocessableEntityError",
    429: "RateLimitError", 431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError",
}  # fmt: skip


class _Unset:
    """No value given (None is one)."""


UNSET = _Unset()

# vLLM's own checks that leave ``param`` null (the message names the field): the sampling
# parameters' ranges (its SamplingParams checks them without naming them, unlike temperature,
# top_p, max_tokens and logprobs)
UNNAMED_FIELDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_p",
    "min_tokens", "stop", "bad_words",
})  # fmt: skip
# and, by (field, our code), the checks whose ``param`` vLLM names otherwise: an empty
# conversation and a prompt's token ids outside the vocabulary (null), ``top_logprobs`` past
# the most alternatives (vLLM checks the count as ``logprobs``, whichever field asked)
VLLM_PARAMS: dict[tuple[str, str | None], str | None] = {
    ("messages", "too_short"): None,
    ("prompt", "invalid_token_id"): None,
    ("top_logprobs", "less_than_equal"): "logprobs",
}


MAX_PARAM_HEADER = 256  # characters: the path may hold a client's own key


def header_text(field: str) -> str:
    """``field`` as a header value: percent-encoded past printable ASCII letters, digits and
    ``._-`` (a client's key may hold any character), at most ``MAX_PARAM_HEADER`` long. A long
    one is cut between characters, never inside one's escapes, so it still decodes."""
    text, size = [], 0
    for char in field:
        escaped = quote(char, safe="._-", errors="replace")
        size += len(escaped)
        if size > MAX_PARAM_HEADER:
            break
        text.append(escaped)
    return "".join(text)


def shown_param(param: str | None, code: str | None) -> str | None:
    """The ``param`` vLLM's answer shows for a check of the field ``param`` (our ``code``):
    null for the checks vLLM makes without naming the field, else the field as vLLM names it."""
    if param is None or param.split(".")[0] in UNNAMED_FIELDS:
        return None
    return VLLM_PARAMS.get((param, code), param)


def error_type(status: int) -> str:
    """vLLM's error ``type`` for an answer of this status."""
    return ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


class APIError(Exception):
    """An error answer, raised anywhere below the routes as one of the kinds below (a field the
    client got wrong, something not found, ...). Its kind decides its HTTP status, here and
    nowhere else; the installed handlers render it in vLLM's shape (``body``), and on
    ``/v1/messages`` in Anthropic's (``anthropic_error``). ``code``: our name for the problem
    (the ``X-Slotserve-Error-Code`` header, the Responses API's ``error.code``). ``param``: the
    field the error is about (the ``X-Slotserve-Error-Param`` header); the body's ``param`` is
    what vLLM's answer shows there (``shown_param``), unless ``shown`` says it."""

    status: ClassVar[int] = 500

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
        shown: str | _Unset | None = UNSET,
    ) -> None:
        super().__init__(message)
        self.message, self.type = message, type or error_type(self.status)
        self.code = code
        self.param = shown_param(param, code) if isinstance(shown, _Unset) else shown
        self.headers = (
            (headers or {})
            | ({ERROR_CODE_HEADER: code} if code else {})
            | ({ERROR_PARAM_HEADER: header_text(param)} if param else {})
        )

    @property
    def server_fault(self) -> bool:
        """Our fault (5xx), not the client's."""
        return self.status >= 500

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.type)

    def json(self) -> bytes:
        return json.dumps(self.body()).encode()


def _kind(name: str, status: int, doc: str) -> type[APIError]:
    """An error kind: its HTTP status."""
    return type(name, (APIError,), {"status": status, "__doc__": doc})


# The error map: each kind of error and its HTTP status (decided here, and only here).
InvalidField = _kind("InvalidField", 400, "A field or header the client got wrong.")
Unauthorized = _kind("Unauthorized", 401, "No valid API key.")
NotFound = _kind("NotFound", 404, "What the request names does not exist.")
Conflict = _kind("Conflict", 409, "It clashes with a live request (a duplicate id).")
TooLarge = _kind("TooLarge", 413, "The request body passes its bound.")
Overloaded = _kind("Overloaded", 429, "Full now: retry (Retry-After).")
ServerFault = _kind("ServerFault", 500, "Our fault: a failed model call, a bug.")
Unavailable = _kind("Unavailable", 503, "Not serving now (loading, ...).")


def documented(*answers: tuple[type[APIError], str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI's ``responses`` of a route: each kind of error it may answer, described."""
    return {kind.status: {"description": text} for kind, text in answers}


# the error answers of the generation routes
ERROR_RESPONSES = documented(
    (InvalidField, "invalid request"),
    (Unauthorized, "missing or invalid API key"),
    (Conflict, "a live request already has this request_id"),
    (TooLarge, "body too large"),
    (Overloaded, "waiting queue full (see Retry-After)"),
    (Unavailable, "draining or engine dead"),
)


def response_for(err: APIError, extra: dict[str, Any] | None = None) -> JSONResponse:
    """The HTTP response of ``err`` (handlers and pure-ASGI middleware answer alike);
    ``extra``: fields next to ``error`` in the body."""
    return JSONResponse(err.body() | (extra or {}), status_code=err.status, headers=err.headers)


def error_body(
    message: str, status: int, param: str | None = None, type: str | None = None
) -> dict[str, Any]:
    """vLLM's error body: ``type`` defaults to vLLM's for ``status``, ``code`` is ``status``."""
    kind = type or error_type(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_json(status: int, message: str) -> bytes:
    """``error_body`` as bytes, for answers written below the app (app.api.connection)."""
    return json.dumps(error_body(message, status)).encode()


def install_error_handlers(app: FastAPI) -> None:
    """The answers to errors raised below the routes: each decided here."""
    for kind, answer in ((APIError, lambda err: err), (InvalidRequestError, invalid_request),
                         (EngineError, refusal)):  # fmt: skip
        app.add_exception_handler(kind, _answering(answer))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


def _answering(answer: Callable[[Any], APIError]) -> Callable[..., Awaitable[JSONResponse]]:
    """An exception handler that answers ``answer(exc)``."""

    async def handler(request: Request, exc: Exception) -> JSONResponse:
        return response_for(answer(exc))

    return handler


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)  # the API key was checked before (auth)
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # where it broke, as vLLM's "body.<position>"
        message = f"request body is not valid JSON: {first.get('msg', '')}"
        return response_for(schema_error(message, None, "json_invalid", _param(first["loc"])))
    chosen, field, problem = _problem(errors)
    code = chosen.get("type")
    if field is None and code in ("model_attributes_type", "missing"):
        message = "request body must be a JSON object (send Content-Type: application/json)"
        return response_for(schema_error(message, None, code))
    message = f"{field or 'body'}: {problem}"
    others = {_field(e) for e in errors} - {_field(chosen)}
    if others:
        message += f" (and {len(others)} more field(s) with problems)"
    if _checked_in_code(field, code):  # vLLM checks it itself: a BadRequestError
        shown = shown_param(_param(_up_to_map(chosen.get("loc", ()))), code)
        return response_for(InvalidField(message, param=field, code=code, shown=shown))
    return response_for(schema_error(message, field, code, _param(first.get("loc", ()))))


# pydantic's errors about a value out of its range (a bound, a length, a pattern, a validator's
# check), not about the body's structure (a missing field, a wrong type, an unknown literal)
VALUE_ERRORS = frozenset({
    "greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of",
    "too_short", "too_long", "string_too_short", "string_too_long", "string_pattern_mismatch",
    "value_error", "assertion_error", "finite_number",
})  # fmt: skip
NUMERIC_BOUNDS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})
# the fields whose numeric bounds vLLM's request schema declares (its other checks are its own
# code): a prompt's token ids (>= 0) and the seed (64 bits)
SCHEMA_BOUNDED = frozenset({"prompt", "seed"})


def _checked_in_code(field: str | None, code: object) -> bool:
    """Whether vLLM refuses this value in its own code (``BadRequestError``), not in its
    request schema (``Bad Request``): a value out of its range, but for the schema's bounds."""
    if code not in VALUE_ERRORS:
        return False
    return not (code in NUMERIC_BOUNDS and (field or "").split(".")[0] in SCHEMA_BOUNDED)


def _up_to_map(loc: Sequence[object]) -> Sequence[object]:
    """``loc`` up to the map whose key is wrong (``logit_bias`` for a key ``"abc"``): a key is
    no field, and vLLM's check names the map."""
    return loc[: list(loc).index("[key]") - 1] if "[key]" in loc else loc


def schema_error(
    message: str, field: str | None, code: str | None, first: str | _Unset | None = UNSET
) -> APIError:
    """400 for a body that fails its schema (or is no JSON), in vLLM's shape for it: type
    ``Bad Request``, ``param`` the path under ``body`` of ``first`` (where vLLM's first error
    is: ``body.messages.0.role``; by default ``field``, the one we report)."""
    where = field if isinstance(first, _Unset) else first
    shown = f"body.{where}" if where else "body"
    return InvalidField(message, param=field, code=code, type=SCHEMA_ERROR, shown=shown)


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
    specific = [(e, p) for e, p in located if not _mismatch(str(e.get("type", "")))]
    if specific:
        chosen, param = specific[0]
        return chosen, param, str(chosen.get("msg", "invalid value"))
    chosen, param = max(located, key=lambda pair: len((pair[1] or "").split(".")))
    kinds = dict.fromkeys(
        str(e.get("msg", "")).removeprefix("Input should be ") for e, p in located if p == param
    )
    return chosen, param, "Input should be " + " or ".join(kinds)


# pydantic's lax mode's failures to read a value as the type ("five" as an integer): type
# mismatches too, so a union member that wanted another type does not hide the member that
# matched (a list of 300 prompts is too long, not "prompt.0: Input should be a valid integer")
COERCION_ERRORS = frozenset({"int_parsing", "int_from_float", "float_parsing", "bool_parsing"})


def _mismatch(code: str) -> bool:
    """Whether pydantic's error ``code`` says the value is of another type."""
    return code.endswith("_type") or code in COERCION_ERRORS


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError | RecursionError):
        # FastAPI's answer to a body json.loads cannot even start on (invalid UTF-8) or gives
        # up on (nested past Python's recursion limit): still a JSON error, so say so
        what = "not UTF-8" if isinstance(exc.__cause__, UnicodeDecodeError) else "nested too deep"
        message = f"request body is not valid JSON: {what}"
        return response_for(schema_error(message, None, "json_invalid"))
    return JSONResponse(
        error_body(str(exc.detail), exc.status_code),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return response_for(ServerFault("internal server error", code="internal_error"))


# The errors a failure can be injected as (app/api/faults.py) are built here, by the functions
# that build the real ones, so an injected failure cannot drift from the real one.

RETRY_AFTER = "1"  # seconds, on 429 (queue full) and 503 (draining, engine dead)


def refusal(err: EngineError) -> APIError:
    """The answer to a submit the engine refused: 429 queue full, 409 duplicate id, 503
    draining or engine dead. 429 and 503 carry ``Retry-After``."""
    retry = {"Retry-After": RETRY_AFTER}
    if isinstance(err, QueueFullError):
        return Overloaded(str(err), code="queue_full", headers=retry)
    if isinstance(err, DuplicateRequestError):
        return Conflict(str(err), param="request_id", code="duplicate_request_id")
    if isinstance(err, ModelLoadFailedError):  # permanent: no Retry-After
        return Unavailable(str(err), code="load_failed")
    if isinstance(err, ModelLoadingError):
        return Unavailable(str(err), code="loading", headers=retry)
    if isinstance(err, NotReadyError):  # asleep, or within --startup-delay
        return Unavailable(str(err), code=err.code, headers=retry)
    code = "draining" if isinstance(err, EngineDrainingError) else "engine_dead"
    return Unavailable(str(err), code=code, headers=retry)


def invalid_api_key() -> APIError:
    """401 for a missing or wrong ``Authorization: Bearer <key>`` (or ``x-api-key``)."""
    return Unauthorized("missing or invalid API key (Authorization: Bearer <key> or x-api-key)",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip


def not_serving(state: str) -> APIError:
    """503 while the server does not serve (``state`` says why: draining, engine_dead, ...)."""
    return Unavailable(f"not serving: {state}", code=state)


def invalid_request(err: InvalidRequestError) -> APIError:
    """400 for a request the model cannot take (``app.serving`` says why and which field)."""
    return InvalidField(str(err), param=err.param, code=err.code)


def model_not_found(requested: str, served: str) -> APIError:
    """404 for an OpenAI ``model`` that this server does not serve."""
    return NotFound(f"model {requested!r} does not exist; this server serves {served!r}",
                    param="model", code="model_not_found")  # fmt: skip


def generation_failed(error: BaseException | None, grammar_param: str | None) -> APIError:
    """The answer to a request that ended in error mid-generation: 400 ``invalid_grammar``
    naming ``grammar_param`` (the field that set the request's grammar) when the grammar engine
    gave up on that grammar (``GrammarLimitError``: the client's grammar is the problem); 400
    ``invalid_value`` when the request's own bans left no token to sample (``NoTokenLeftError``);
    else 500 ``model_error`` (a failed model call, or a model that broke its contract)."""
    if isinstance(error, GrammarLimitError):
        param = grammar_param or "response_format"
        message = f"{param}: the grammar engine gave up on this grammar mid-generation: {error}"
        return InvalidField(message, param=param, code="invalid_grammar")
    if isinstance(error, NoTokenLeftError):
        return InvalidField(str(error), code="invalid_value")
    return ServerFault(f"model call failed: {error!r}", code="model_error")


# --- Anthropic's shape (on /v1/messages, app.api.adapters.anthropic_errors) ----------------

ANTHROPIC_OVERLOADED = 529
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    ANTHROPIC_OVERLOADED: "overloaded_error",
}  # any other 4xx: invalid_request_error; any other 5xx: api_error
ANTHROPIC_STATUS = {Unavailable.status: ANTHROPIC_OVERLOADED}


def anthropic_error(status: int, body: bytes) -> tuple[int, bytes]:
    """The status and body of an error answer in Anthropic's shape."""
    status = ANTHROPIC_STATUS.get(status, status)
    try:
        error = json.loads(body)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param = body.decode("utf-8", "replace"), None
    if isinstance(param, str):  # vLLM's schema family puts it under "body."
        param = param.removeprefix("body.")
    if isinstance(param, str) and param not in message:  # Anthropic's shape has no param
        message = f"{param}: {message}"
    shaped = {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
    return status, json.dumps(shaped).encode()


def anthropic_type(status: int) -> str:
    """Anthropic's error type for an answer of this status."""
    return ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def is_error(status: int) -> bool:
    """Whether an HTTP answer of this status is an error answer."""
    return status >= 400
