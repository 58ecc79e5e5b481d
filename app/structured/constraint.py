"""``Constraint``: what a request's generated text must match. Built by the API adapters from
their request fields; compiled by ``GrammarCompiler`` for one tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

MAX_MESSAGE = 300  # characters of a compiler message kept in an error


class ConstraintKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # ``source``: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (``source`` unused)
    REGEX = "regex"  # ``source``: a regular expression the whole output matches
    CHOICE = "choice"  # ``source``: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # ``source``: a Lark grammar (or GBNF, converted)


class ConstraintError(ValueError):
    """The constraint cannot be compiled (an invalid or unsupported schema, a regex that does not
    compile, a bad grammar): the client's mistake. The message is the compiler's, shortened."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """One request's output constraint; ``source`` is text so the value is hashable."""

    kind: ConstraintKind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> Constraint:
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema))  # property order kept

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        if not options:
            raise ConstraintError("choice needs at least one option")
        return cls(ConstraintKind.CHOICE, json.dumps(options))

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        return cls(ConstraintKind.GRAMMAR, text)


def shorten(message: str) -> str:
    """A compiler message on one line, at most ``MAX_MESSAGE`` characters."""
    text = " ".join(message.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."
