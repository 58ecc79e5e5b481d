"""A minimal server-sent-events parser for tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Event:
    event: str
    data: Any


def parse_sse(body: str) -> list[Event]:
    """Events of a complete SSE body; comments (pings) are skipped, ``data`` is JSON-decoded
    except the OpenAI terminator ``[DONE]``."""
    events = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            raw = "\n".join(data)
            events.append(Event(name, raw if raw == "[DONE]" else json.loads(raw)))
    return events
