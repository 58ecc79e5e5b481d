"""The recorder: sends the corpus (corpus.json) to a server, one request at a time in order, and
keeps each answer as it came (status, media type, text). A capture is ``{"server": ...,
"answers": {name: answer}}``, written as JSON with one answer per line; it is normalised when
compared (normalise.py), so a change to the normalisation needs no new recording of vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

CORPUS = Path(__file__).with_name("corpus.json")
TIMEOUT = 300.0  # seconds per request (a CPU model, 32 tokens at most)


def load_corpus(path: Path = CORPUS) -> list[dict[str, Any]]:
    """The corpus's requests, in the order they are sent."""
    requests: list[dict[str, Any]] = json.loads(path.read_text())["requests"]
    return requests


def send(client: httpx.Client, request: dict[str, Any]) -> dict[str, Any]:
    """One corpus request's answer: ``{"status", "media_type", "text"}``."""
    content: str | None = request.get("raw")
    if "body" in request:
        content = json.dumps(request["body"])
    headers = {"content-type": "application/json"} if content is not None else {}
    answer = client.request(request["method"], request["path"], content=content, headers=headers)
    media_type = answer.headers.get("content-type", "").split(";")[0].strip()
    return {"status": answer.status_code, "media_type": media_type, "text": answer.text}


def record(
    base_url: str, server: str, corpus: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The capture of the server at ``base_url`` (``server`` names it in the capture)."""
    with httpx.Client(base_url=base_url, timeout=TIMEOUT) as client:
        answers = {req["name"]: send(client, req) for req in corpus or load_corpus()}
    return {"server": server, "answers": answers}


def dump(capture: dict[str, Any]) -> str:
    """``capture`` as JSON text, one answer per line."""
    lines = [f"  {json.dumps(name)}: {json.dumps(answer, sort_keys=True)}"
             for name, answer in capture["answers"].items()]  # fmt: skip
    server = json.dumps(capture["server"])
    return f'{{"server": {server},\n "answers": {{\n' + ",\n".join(lines) + "\n}}\n"
