"""Named API keys: parsed and checked once at start, matched in constant time per request.

Sources (all merged): ``--api-key`` entries (repeatable), ``SLOTSERVE_API_KEY`` (a comma-
separated list of entries) and ``--api-keys-file`` (one entry a line; blank lines and lines
starting with ``#`` are skipped). An entry is ``NAME:KEY``, or a bare ``KEY`` named ``default``;
a key that contains ``:`` must be given with a name. Surrounding whitespace (a trailing newline
from a secret file) is stripped. Refused, with a one-line message that never shows a key: an
empty key, a key with a character outside printable ASCII (it could never match a header), a bad
name, and a name or key given twice.

No HTTP here: the API layer turns a failed match into its 401.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAME = "default"
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII without space


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    secret: bytes

    def __repr__(self) -> str:  # a key is never shown, not even in a traceback
        return f"ApiKey(name={self.name!r})"


class ApiKeys:
    """The configured keys. Empty: no authentication."""

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self.keys = tuple(keys)
        names = [key.name for key in self.keys]
        if len(set(names)) != len(names):
            twice = next(name for i, name in enumerate(names) if name in names[:i])
            raise ValueError(f"API key name {twice!r} is given twice")
        if len({key.secret for key in self.keys}) != len(self.keys):
            raise ValueError("the same API key is given twice (under two names)")

    @classmethod
    def parse(cls, entries: Iterable[str], file: Path | None = None) -> ApiKeys:
        """Keys from ``entries`` and ``file``; ``ValueError`` naming the bad entry's place."""
        keys = [parse_entry(entry, f"entry {n}") for n, entry in enumerate(entries, 1)]
        if file is not None:
            keys += read_file(file)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @property
    def names(self) -> list[str]:
        return [key.name for key in self.keys]

    def match(self, token: bytes) -> str | None:
        """The name of the key equal to ``token``, or None. Every key is compared in constant
        time, so the answer's timing does not depend on which key, if any, matched."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(token, key.secret):
                found = key.name
        return found


def parse_entry(entry: str, where: str) -> ApiKey:
    name, sep, secret = entry.strip().partition(":")
    if not sep:
        name, secret = DEFAULT_NAME, name
    name, secret = name.strip(), secret.strip()
    if not NAME.fullmatch(name):
        raise ValueError(f"API key {where}: name must be 1-64 of [A-Za-z0-9._-]")
    if not secret:
        raise ValueError(f"API key {where} ({name}) is empty")
    if not KEY.fullmatch(secret):
        raise ValueError(f"API key {where} ({name}) has a character outside printable ASCII")
    return ApiKey(name, secret.encode("ascii"))


def read_file(path: Path) -> list[ApiKey]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(
            f"cannot read API keys file {str(path)!r}: {err.__class__.__name__}"
        ) from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.strip()
        if entry and not entry.startswith("#"):
            keys.append(parse_entry(entry, f"{path.name} line {number}"))
    if not keys:
        raise ValueError(f"API keys file {str(path)!r} holds no key")
    return keys
