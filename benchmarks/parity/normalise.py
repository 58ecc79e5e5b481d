"""A server's answer reduced to what a client, dashboard or router depends on.

Kept: the status, the media type, every JSON key and the type of every value, and the values
clients dispatch on (``KEPT_VALUES``: ``object``, ``type``, ``finish_reason``, error codes, token
counts of prompts ...). Dropped: keys whose value is null (a client reads an absent field and a
null one alike); ids, timestamps, generated text, log-probability values (each
becomes ``"<str>"``, ``"<int>"``, ``"<float>"``). A stream keeps its framing: each event's name and
normalised data, runs of equal events folded into one. ``/metrics`` keeps each ``vllm:`` family's
type, label names, ``engine`` values and histogram buckets.
"""

from __future__ import annotations

import json
import re
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Json = Any

# keys whose string (or integer) values are kept: what clients, routers and SDKs branch on
KEPT_VALUES = frozenset({
    "object", "type", "finish_reason", "stop_reason", "role", "status", "model", "code",
    "param", "event", "reason", "stop_sequence", "tool_choice", "truncation", "service_tier",
    "index", "prompt_tokens", "input_tokens", "count", "max_model_len", "tokens", "token_strs",
    "name", "store", "background", "parallel_tool_calls",
})  # fmt: skip
# dicts keyed by token text or token id (top_logprobs of completions, vLLM's prompt_logprobs)
TOKEN_KEYED = frozenset({"top_logprobs", "prompt_logprobs"})
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def type_name(value: Json) -> str:
    """The JSON type of ``value`` as a placeholder (``"<str>"`` ...)."""
    if isinstance(value, bool):
        return "<bool>"
    if isinstance(value, int):
        return "<int>"
    if isinstance(value, float):
        return "<float>"
    return "<str>"


def fold(items: list[Json]) -> list[Json]:
    """``items`` with each run of equal neighbours folded into one (lengths vary with text)."""
    folded: list[Json] = []
    for item in items:
        if not folded or folded[-1] != item:
            folded.append(item)
    return folded


def normalise_json(
    value: Json, key: str | None = None, loose: frozenset[str] = frozenset()
) -> Json:
    """``value`` (decoded JSON found under ``key``) with what varies run to run replaced by its
    type, keeping the structure and the values under ``KEPT_VALUES`` keys not in ``loose``."""
    if isinstance(value, dict):
        if key in TOKEN_KEYED and not all(_IDENTIFIER.match(k) for k in value):
            # keyed by token: one entry stands for all (the keys are generated text)
            first = next(iter(value.values()))
            return {"<token>": normalise_json(first, "<token>", loose)}
        # a null field is an absent one to a client (SDKs read both as None)
        return {k: normalise_json(v, k, loose) for k, v in sorted(value.items()) if v is not None}
    if isinstance(value, list):
        return fold([normalise_json(item, key, loose) for item in value])
    if value is None or isinstance(value, bool):
        return value
    if key in KEPT_VALUES and key not in loose:
        return value
    return type_name(value)


def parse_sse(text: str, loose: frozenset[str] = frozenset()) -> list[dict[str, Json]]:
    """The events of an SSE body, each ``{"event": name or None, "data": normalised}``;
    comments (keep-alive pings) dropped, runs of equal events folded."""
    events: list[dict[str, Json]] = []
    for block in re.split(r"\r?\n\r?\n", text):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if not data and name is None:
            continue
        payload = "\n".join(data)
        try:
            body: Json = normalise_json(json.loads(payload), None, loose)
        except json.JSONDecodeError:
            body = payload if payload == "[DONE]" else "<text>"
        events.append({"event": name, "data": body})
    return fold(events)


def metric_families(text: str) -> dict[str, Json]:
    """Each ``vllm:`` family of a Prometheus text exposition: its type, label names (``le``
    aside), the ``engine`` label's values and, for a histogram, its bucket bounds."""
    families: dict[str, Json] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
        engines = sorted({s.labels["engine"] for s in family.samples if "engine" in s.labels})
        entry: dict[str, Json] = {"type": family.type, "labels": labels, "engine": engines}
        if family.type == "histogram":
            bounds = {float(s.labels["le"]) for s in family.samples if "le" in s.labels}
            entry["buckets"] = [repr(b) for b in sorted(bounds)]
        families[family.name] = entry
    return families


def normalise_answer(
    status: int, media_type: str, text: str, loose: frozenset[str] = frozenset()
) -> dict[str, Json]:
    """One answer, normalised: ``{"status", "media_type", "body"}`` (``loose``: keys whose
    values are compared by type only in this answer)."""
    body: Json
    if media_type == "text/event-stream":
        body = parse_sse(text, loose)
    elif media_type == "application/json":
        try:
            body = normalise_json(json.loads(text), None, loose)
        except json.JSONDecodeError:
            body = "<invalid json>"
    elif "# TYPE" in text:
        body = metric_families(text)
    else:
        body = "<text>" if text else ""
    return {"status": status, "media_type": media_type, "body": body}
