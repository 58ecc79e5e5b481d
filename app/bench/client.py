"""One streamed request against a target API, timed as ``vllm bench serve`` times it.

``send()`` posts one ``RequestSpec`` and reads the SSE body from ``aiter_raw()`` with
``SSEDecoder``. It records the send time, the arrival time of every chunk that carried output,
and the output tokens received. It never raises for a request's failure: a bad status, a
transport error, an ``error`` event or a stream cut before its end make a ``failed`` result.
With ``spec.cancel_after`` set, it closes the connection once that many tokens arrived, as an
impatient user does (the server sees the disconnect and aborts the request).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx

from app.bench.sse import SSEDecoder
from app.bench.workload import RequestSpec

Status = Literal["completed", "cancelled", "failed"]


@dataclass(slots=True)
class RequestResult:
    """What happened to one request. Times are ``time.monotonic()`` seconds (system-wide on
    Linux, so comparable across worker processes). ``chunks`` holds the arrival time of each
    read that carried at least one output token."""

    index: int
    group: str
    prompt_len: int
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    status: Status = "failed"
    error: str | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class Parsed:
    """One event's meaning: output tokens it carried, whether the stream ended, and how."""

    tokens: int = 0
    end: bool = False
    error: str | None = None
    finish_reason: str | None = None
    total_tokens: int | None = None  # an authoritative count (OpenAI usage), if given


class Target(Protocol):
    """An API: the path to POST to, the JSON body for a spec, and what each event means."""

    path: str

    def body(self, spec: RequestSpec) -> dict[str, Any]: ...

    def parse(self, name: str, data: bytes) -> Parsed: ...


class NativeTarget:
    """slotserve's ``POST /generate``: token ids in, ``token`` events with ids out, then a
    ``done`` or ``error`` event. Tokens are counted from the ids of each event."""

    path = "/generate"

    def __init__(self, ignore_eos: bool = True, temperature: float | None = None) -> None:
        self.ignore_eos, self.temperature = ignore_eos, temperature

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(spec.prompt),
            "max_tokens": spec.max_tokens,
            "ignore_eos": self.ignore_eos,
            "stream": True,
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    def parse(self, name: str, data: bytes) -> Parsed:
        if name == "token":
            return Parsed(tokens=count_token_ids(data))
        if name == "done":
            return Parsed(end=True, finish_reason=json.loads(data).get("finish_reason"))
        if name == "error":
            return Parsed(end=True, error=_error_message(data))
        return Parsed()


class OpenAITarget:
    """``POST /v1/completions`` with ``stream: true``: each chunk with text counts as one token
    until the usage chunk (``stream_options.include_usage``) gives the exact count; the stream
    ends with ``data: [DONE]``. Works against vLLM, TGI, llama.cpp or slotserve."""

    path = "/v1/completions"

    def __init__(
        self, model: str | None = None, ignore_eos: bool = True, temperature: float | None = None
    ) -> None:
        self.model, self.ignore_eos, self.temperature = model, ignore_eos, temperature

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": "".join(chr(97 + t % 26) for t in spec.prompt),
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.ignore_eos,
        }
        if self.model:
            body["model"] = self.model
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    def parse(self, name: str, data: bytes) -> Parsed:
        if data == b"[DONE]":
            return Parsed(end=True)
        chunk = json.loads(data)
        if "error" in chunk:
            return Parsed(end=True, error=_message_of(chunk))
        parsed = Parsed()
        choices = chunk.get("choices") or []
        if choices:
            parsed.tokens = 1 if choices[0].get("text") else 0
            parsed.finish_reason = choices[0].get("finish_reason")
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            parsed.total_tokens = int(usage["completion_tokens"])
        return parsed


def count_token_ids(data: bytes) -> int:
    """The number of ids in a native token event's ``"tokens": [...]`` list, without a JSON
    decoder (the list holds only integers, so its commas count its items)."""
    key = data.find(b'"tokens":')
    if key < 0:
        return 0
    start = data.find(b"[", key) + 1
    end = data.find(b"]", start)
    if start == 0 or end < 0 or not data[start:end].strip():
        return 0
    return data.count(b",", start, end) + 1


async def send(client: httpx.AsyncClient, target: Target, spec: RequestSpec) -> RequestResult:
    """Send ``spec`` and read its whole stream (or cancel it); see the module docstring."""
    result = RequestResult(spec.index, spec.group, len(spec.prompt))
    result.sent = time.monotonic()
    try:
        async with client.stream("POST", target.path, json=target.body(spec)) as response:
            if response.status_code != 200:
                body = await response.aread()
                result.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return result
            await _read(response, target, spec, result)
    except httpx.HTTPError as err:
        result.status, result.error = "failed", f"{type(err).__name__}: {err}"
    except ValueError as err:  # an event whose data is not the JSON the API promises
        result.status, result.error = "failed", f"bad event: {err}"
    return result


async def _read(
    response: httpx.Response, target: Target, spec: RequestSpec, result: RequestResult
) -> None:
    decoder = SSEDecoder()
    raw = response.aiter_bytes() if response.headers.get("content-encoding") else None
    total: int | None = None
    async for data in raw or response.aiter_raw():
        now = time.monotonic()
        got = 0
        for name, payload in decoder.feed(data):
            parsed = target.parse(name, payload)
            got += parsed.tokens
            total = parsed.total_tokens if parsed.total_tokens is not None else total
            result.finish_reason = parsed.finish_reason or result.finish_reason
            if parsed.end:
                _account(result, now, got, total)
                result.status = "failed" if parsed.error else "completed"
                result.error = parsed.error
                return
        _account(result, now, got, None)
        if spec.cancel_after is not None and result.tokens >= spec.cancel_after:
            result.status = "cancelled"
            return  # leaving the stream's context closes the connection
    result.error = "the stream ended without a final event"


def _account(result: RequestResult, now: float, got: int, total: int | None) -> None:
    if got:
        result.chunks.append(now)
        result.tokens += got
    if total is not None:
        result.tokens = total


def _error_message(body: bytes) -> str:
    try:
        return _message_of(json.loads(body))
    except ValueError:
        return body[:200].decode(errors="replace") or "(empty body)"


def _message_of(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in payload:
            return str(payload["detail"])
    return str(payload)[:200]
