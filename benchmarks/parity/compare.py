"""The comparer: two captures (record.py) -> the differences, each a request, a path into its
normalised answer and the two values; and which of them the accepted list (accepted.py) covers."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from parity.accepted import ACCEPTED, Accepted
from parity.normalise import normalise_answer
from parity.record import load_corpus

MISSING = "<missing>"


@dataclass(frozen=True, slots=True)
class Difference:
    """At ``path`` of ``request``'s answer, vLLM has ``vllm`` and slotserve ``ours``."""

    request: str
    path: str
    vllm: Any
    ours: Any

    def __str__(self) -> str:
        return f"{self.request} {self.path}: vllm {_short(self.vllm)} / ours {_short(self.ours)}"


def _short(value: Any) -> str:
    text = value if value == MISSING else json.dumps(value, sort_keys=True)
    return text if len(text) <= 160 else text[:157] + "..."


def diff(request: str, path: str, vllm: Any, ours: Any) -> list[Difference]:
    """Where ``ours`` differs from ``vllm`` (normalised answers or parts of them)."""
    if isinstance(vllm, dict) and isinstance(ours, dict):
        found: list[Difference] = []
        for key in sorted(vllm.keys() | ours.keys()):
            where = f"{path}.{key}"
            if key not in ours:
                found.append(Difference(request, where, vllm[key], MISSING))
            elif key not in vllm:
                found.append(Difference(request, where, MISSING, ours[key]))
            else:
                found += diff(request, where, vllm[key], ours[key])
        return found
    if isinstance(vllm, list) and isinstance(ours, list):
        return _diff_lists(request, path, vllm, ours)
    return [] if vllm == ours else [Difference(request, path, vllm, ours)]


def _diff_lists(request: str, path: str, vllm: list[Any], ours: list[Any]) -> list[Difference]:
    """Lists aligned as sequences (an extra stream event shifts no other)."""
    keys = (
        [json.dumps(v, sort_keys=True) for v in vllm],
        [json.dumps(v, sort_keys=True) for v in ours],
    )
    found: list[Difference] = []
    matcher = difflib.SequenceMatcher(a=keys[0], b=keys[1], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag == "replace" and i2 - i1 == j2 - j1:
            for offset in range(i2 - i1):
                found += diff(request, f"{path}[{i1 + offset}]", vllm[i1 + offset],
                              ours[j1 + offset])  # fmt: skip
            continue
        theirs = vllm[i1:i2] if i2 > i1 else MISSING
        mine = ours[j1:j2] if j2 > j1 else MISSING
        found.append(Difference(request, f"{path}[{i1}:{i2}]", theirs, mine))
    return found


def normalised(capture: dict[str, Any]) -> dict[str, Any]:
    """A capture's answers, each normalised as its corpus entry says (``loose``: keys whose
    values the generated text decides, compared by type)."""
    loose = {req["name"]: frozenset(req.get("loose", ())) for req in load_corpus()}
    return {
        name: normalise_answer(
            a["status"], a["media_type"], a["text"], loose.get(name, frozenset())
        )
        for name, a in capture["answers"].items()
    }


def compare(vllm: dict[str, Any], ours: dict[str, Any]) -> list[Difference]:
    """Every difference between two captures (requests missing from either included)."""
    found: list[Difference] = []
    theirs, mine = normalised(vllm), normalised(ours)
    for name in theirs.keys() | mine.keys():
        found += diff(name, "", theirs.get(name, MISSING), mine.get(name, MISSING))
    return sorted(found, key=lambda d: (d.request, d.path))


def accepted_by(
    difference: Difference, accepted: tuple[Accepted, ...] = ACCEPTED
) -> Accepted | None:
    """The accepted entry covering ``difference`` (None: it fails the parity test)."""
    for entry in accepted:
        if any(fnmatchcase(difference.request, r) for r in entry.requests) and any(
            fnmatchcase(difference.path, p) for p in entry.paths
        ):
            return entry
    return None


def differing_requests(differences: list[Difference]) -> list[str]:
    """The requests whose answers differ at all, sorted."""
    return sorted({d.request for d in differences})
