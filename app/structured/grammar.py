"""Compiling constraints with llguidance, and the per-request matcher the engine drives.

``GrammarCompiler`` is built once per model (its vocabulary; see ``vocab``). ``matcher(c)``
compiles ``c`` (under a millisecond for a typical schema: llguidance builds its automata
lazily) and returns a fresh ``GrammarMatcher`` or raises ``ConstraintError`` with the
compiler's message. The matcher is the engine's ``TokenConstraint``: the runner asks it for
the mask of the next token (or, for a model that cannot apply a mask, to choose an allowed
token), the scheduler feeds it every accepted token.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from app.engine.errors import GrammarLimitError, ModelOutputError
from app.models.tokenizer import Tokenizer
from app.structured.constraint import Constraint, ConstraintError, ConstraintKind, shorten
from app.structured.vocab import grammar_vocabulary

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # only in the type stubs

# JSON is generated compact: no free whitespace (a model cannot pad it forever, and a mock's
# spaces are not taken as JSON's), "," and ":" separators.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# A model that cannot apply masks (the mocks) keeps its own token while the grammar allows it and
# the current run (tokens since the last structural character) is shorter than this; then it
# prefers tokens that close the structure (see ``GrammarMatcher.choose``).
RUN_LIMIT = 24
TEMPLATES = 256  # compiled grammars kept (see GrammarCompiler.matcher)
TEMPLATE_BYTES = 2 << 20  # ... and their sources' total size (compiled: tens of times more)
MAX_SOURCE = 64 << 10  # a constraint's source at most (a schema, regex, grammar, choices)
STRUCTURAL = '"{}[],:'
# llguidance's error for a token its grammar does not allow (its other errors after compiling are
# its limits: "Current row has N items; max is M", "Too many items (limit N; mask)", lexer fuel)
REJECTED = "doesn't satisfy the grammar"
CLOSING = ('"', "}", "]", ",")  # after EOS, in this order: strings, objects, arrays, items
NUMBER = "1"  # a value that must start (no string, object or array allowed): a number


Steering = tuple[tuple[int, ...], int | None, frozenset[int]]  # closing, number, structural ids


def allowed(mask: bytes, token: int) -> bool:
    """Whether bit ``token`` of ``mask`` (little-endian bit order, llguidance's layout) is set."""
    index = token >> 3
    return index < len(mask) and bool(mask[index] >> (token & 7) & 1)


class GrammarMatcher:
    """One request's grammar state (an ``llguidance.LLMatcher``). Not thread-safe: the engine
    uses it from one thread at a time (the runner before a call, the scheduler after it).

    ``choose`` consumes the token it keeps (one parser step instead of a check and then a
    step); that token is *pending* until ``accept`` confirms it. If the request's token was
    dropped instead (aborted or preempted during the call), the next ``choose`` or ``mask``
    rolls it back first, so the matcher always stands after exactly the accepted tokens."""

    __slots__ = (
        "__weakref__",
        "_closing",
        "_eos",
        "_matcher",
        "_number",
        "_pending",
        "_run",
        "_steered",
        "_structural",
    )

    def __init__(self, matcher: Any, eos: int, steering: Steering) -> None:
        self._matcher = matcher
        self._eos = eos
        self._closing, self._number, self._structural = steering
        self._pending: int | None = None
        self._run = 0  # accepted tokens since the last structural one (for ``choose``)
        self._steered = 0  # ``choose`` calls in a row that could not keep the model's token

    def mask(self) -> bytes:
        """The allowed next tokens as a bitmask: bit t (byte t // 8, bit t % 8) is token t."""
        self._settle()
        return bytes(self._matcher.compute_bitmask())

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar forbids it or llguidance gave up on the
        grammar (see ``refusal``; the matcher is then broken). A matcher in its error state
        still takes EOS (its masks then allow only EOS), so that is checked after the step:
        the request must not end as if its grammar had."""
        pending, self._pending = self._pending, None
        if pending != token:
            if pending is not None:
                self._matcher.rollback(1)
            if not self._matcher.consume_token(token):
                return False
        if self._matcher.is_error():  # ~40 ns
            return False
        self._run = 0 if token in self._structural else self._run + 1
        return True

    def refusal(self, token: int) -> Exception:
        """Why ``accept(token)`` returned False (the matcher is in its error state):
        ``ModelOutputError`` if the grammar rejected the token (a model that broke the mask it
        was given), else ``GrammarLimitError`` with llguidance's reason (it gave up on the
        grammar: a limit on its work per token; see ``limit_reason``)."""
        message = self._matcher.get_error()
        if REJECTED in message:
            return ModelOutputError(
                f"the model emitted token {token}, which the request's grammar forbids"
            )
        return GrammarLimitError(limit_reason(message))

    @property
    def finished(self) -> bool:
        """The grammar ended (its end token was accepted): nothing more may be generated."""
        return bool(self._matcher.is_stopped())

    def choose(self, preferred: int) -> int:
        """The token a model that cannot apply a mask emits: ``preferred`` while the grammar
        allows it and the current run is short, else the first allowed of EOS and the closing
        tokens, else ``preferred`` if allowed, else the lowest allowed id; after ``RUN_LIMIT``
        such choices in a row, EOS or an allowed token in a deterministic rotation (so a cycle
        of preferences cannot last). It steers toward completing the structure."""
        self._settle()
        if self._run < RUN_LIMIT and self._matcher.try_consume_tokens([preferred]) == 1:
            self._pending = preferred
            self._steered = 0
            return preferred
        mask = bytes(self._matcher.compute_bitmask())
        self._steered += 1
        if self._steered > RUN_LIMIT:  # the preferences below may cycle (a closing byte that is
            return self._rotate(mask)  # also string content, an alternation): rotate instead
        for token in (self._eos, *self._closing):
            if allowed(mask, token):
                return token
        if self._number is not None and allowed(mask, self._number) and not self._run:
            return self._number
        if allowed(mask, preferred):
            return preferred
        for index, byte in enumerate(mask):
            if byte:
                return index * 8 + (byte & -byte).bit_length() - 1
        return self._eos  # nothing allowed: the grammar is broken; end the request

    def _rotate(self, mask: bytes) -> int:
        """EOS if allowed, else an allowed token picked by a deterministic rotation."""
        if allowed(mask, self._eos):
            return self._eos
        ids = [
            i * 8 + bit
            for i, byte in enumerate(mask)
            if byte
            for bit in range(8)
            if byte >> bit & 1
        ]
        return ids[((self._steered * 0x9E3779B1) >> 16) % len(ids)] if ids else self._eos

    def _settle(self) -> None:
        """Roll back a token ``choose`` consumed that was never accepted (it was dropped)."""
        if self._pending is not None:
            self._pending = None
            self._matcher.rollback(1)


class GrammarCompiler:
    """Compiles constraints for one tokenizer's vocabulary."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._vocab = grammar_vocabulary(tokenizer)
        self._templates: OrderedDict[Constraint, Any] = OrderedDict()  # LRU: compiled grammars
        self._template_bytes = 0
        self._lock = threading.Lock()  # the LRU: compiles may run on worker threads
        self.vocab_size = tokenizer.vocab_size
        self._eos = tokenizer.eos_token_id
        number = _single_tokens(tokenizer, (NUMBER,))
        self._steering: Steering = (
            _single_tokens(tokenizer, CLOSING),
            number[0] if number else None,
            frozenset(_single_tokens(tokenizer, tuple(STRUCTURAL))),
        )

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for ``constraint``; ``ConstraintError`` if it does not compile.

        The compiled grammars of the last ``TEMPLATES`` distinct constraints (sources of
        ``TEMPLATE_BYTES`` at most in all; a source is at most ``MAX_SOURCE``) are kept, and a
        request gets a copy of it (~3 us instead of ~1 ms): the copies share the grammar's
        lazily built lexer states, so the requests of one schema warm them for each other
        (measured: 5.7 instead of 15 us per token over a short reply)."""
        if len(constraint.source) > MAX_SOURCE:
            raise ConstraintError(
                f"too large: {len(constraint.source)} characters (at most {MAX_SOURCE})"
            )
        with self._lock:
            template = self._templates.get(constraint)
            if template is not None:
                self._templates.move_to_end(constraint)
        if template is None:  # compiled outside the lock (it may run on a worker thread)
            template = llguidance.LLMatcher(self._vocab, grammar_text(constraint), log_level=0)
            if template.is_error():
                raise ConstraintError(shorten(template.get_error()))
            self._keep(constraint, template)
        return GrammarMatcher(template.deep_copy(), self._eos, self._steering)

    def _keep(self, constraint: Constraint, template: Any) -> None:
        """Cache a compiled grammar, evicting the least recently used past the bounds."""
        with self._lock:
            if constraint in self._templates:
                return
            self._templates[constraint] = template
            self._template_bytes += len(constraint.source)
            while len(self._templates) > TEMPLATES or self._template_bytes > TEMPLATE_BYTES:
                old, _ = self._templates.popitem(last=False)
                self._template_bytes -= len(old.source)


def limit_reason(message: str) -> str:
    """llguidance's error ``message`` without its parser-state dump and its prefix, shortened:
    e.g. "Current row has 2003 items; max is 2000; consider making your grammar left-recursive
    if it's right-recursive"."""
    reason = message.split("<state>", 1)[0].strip()
    for prefix in ("Parser Error:", "parser error:"):
        reason = reason.removeprefix(prefix).strip()
    return shorten(reason or "the grammar engine gave up on this grammar")


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for ``constraint`` (not yet checked: the matcher does that)."""
    kind, source = constraint.kind, constraint.source
    try:
        if kind is ConstraintKind.JSON_SCHEMA:
            return str(llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS))
        if kind is ConstraintKind.JSON_OBJECT:
            schema = {"type": "object"}
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
        if kind is ConstraintKind.REGEX:
            return str(llguidance.LLMatcher.grammar_from_regex(source))
        if kind is ConstraintKind.CHOICE:  # one lexeme: scales to many options (a Lark
            options = "|".join(map(regex_literal, json.loads(source)))  # alternation does not)
            return str(llguidance.LLMatcher.grammar_from_regex(f"(?:{options})"))
        text = gbnf_to_lark(source) if "::=" in source else source
        return str(llguidance.LLMatcher.grammar_from_lark(text))
    except (ValueError, TypeError) as err:
        raise ConstraintError(shorten(str(err))) from None


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def regex_literal(text: str) -> str:
    """``text`` as a regex that matches exactly it (its metacharacters escaped)."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def _single_tokens(tokenizer: Tokenizer, texts: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of the texts that are one token each (others are left out)."""
    ids = [tokenizer.encode(text) for text in texts]
    return tuple(one[0] for one in ids if len(one) == 1)
