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
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from time import perf_counter_ns, thread_time_ns
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from app.engine.errors import GrammarLimitError, ModelOutputError
from app.models.tokenizer import ByteTokenizer, Tokenizer
from app.structured.constraint import Constraint, ConstraintError, ConstraintKind, shorten
from app.structured.vocab import grammar_vocabulary

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # only in the type stubs

# llguidance reports a grammar's end (and its errors) as a Rust error value, which captures a
# backtrace when RUST_BACKTRACE is set (as on many development machines): ~30 us per request's
# end, never shown to anyone. Library backtraces are off unless asked for by their own variable
# (panics still honour RUST_BACKTRACE). Read once, at the first error: set before any.
os.environ.setdefault("RUST_LIB_BACKTRACE", "0")

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
# llguidance's errors after compiling that are its limits on the work per token (the grammar's
# fault: "Current row has N items; max is M", "Too many items (limit N; mask)", lexer fuel, too
# many lexer states); any other error (a token the grammar rejects, an id outside the
# vocabulary, a token after the end) is the model's
LIMITS = ("items; max is", "Too many items", "fuel", "too many states")
CLOSING = ('"', "}", "]", ",")  # after EOS, in this order: strings, objects, arrays, items
NUMBER = "1"  # a value that must start (no string, object or array allowed): a number
NONE = -1  # no token
# A token whose grammar work took at least this long (wall time, ns) has its next token's work
# timed in thread CPU time (see ``GrammarBudget``): cheap tokens pay two perf-counter reads only
HEAVY_NS = 1_000_000


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """The CPU time a request's grammar work may take (``--max-grammar-ms-per-token``,
    ``--max-grammar-ms-per-request``): past either, the matcher gives up on the grammar and the
    request ends with ``GrammarLimitError`` (the client's ``invalid_grammar``), as it does at
    llguidance's own limits. The work is counted in the CPU time of the thread doing it (other
    processes and the event loop do not count against a request), from the first token whose
    work took ``HEAVY_NS`` or more (by the wall clock) on: typical grammars cost microseconds a
    token and are never timed that way (a clock read of the thread's CPU costs ~0.5 us), and
    once a grammar has been expensive every later token of the request is timed, so tokens
    that alternate between cheap and expensive cannot slip through. That first expensive token
    counts its wall time. ``per_request_ms`` bounds the time spent from there on by all the
    request's choices together (their matchers share one ``GrammarSpend``), and each timed
    token's work is checked against ``per_token_ms``. Zero: no limit."""

    per_token_ms: float = 0.0
    per_request_ms: float = 0.0


NO_BUDGET = GrammarBudget()


@dataclass(slots=True)
class GrammarSpend:
    """The CPU time (ns) one request's timed grammar work took, shared by its choices' matchers
    (``n``, several prompts), so ``per_request_ms`` bounds the request, not each choice."""

    ns: int = 0


Steering = tuple[tuple[int, ...], int | None, frozenset[int]]  # closing, number, structural ids


def allowed(mask: bytes, token: int) -> bool:
    """Whether bit ``token`` of ``mask`` (little-endian bit order, llguidance's layout) is set."""
    index = token >> 3
    return index < len(mask) and bool(mask[index] >> (token & 7) & 1)


class GrammarMatcher:
    """One request's grammar state (an ``llguidance.LLMatcher``). Not thread-safe: the engine
    uses it from one thread at a time (the runner before a call, the scheduler after it).

    ``choose`` consumes the token it returns (one parser step instead of a check and then a
    step); that token is *pending* until ``accept`` confirms it. Where the grammar forces the
    next tokens (``{"name":"`` in a JSON object) and the vocabulary is one byte per token (the
    mocks'), ``choose`` consumes the whole forced run in one call and returns a token of it
    per step without a parser call: the rest of the run is *ahead*. If the pending token was
    dropped instead (aborted or preempted during the call), the next ``choose`` or ``mask``
    rolls back the pending and ahead tokens first, so the matcher always answers as if it
    stood after exactly the accepted tokens."""

    __slots__ = (
        "__weakref__",
        "_ahead",
        "_closing",
        "_cost_ns",
        "_eos",
        "_exceeded",
        "_forced_bytes",
        "_heavy_ns",
        "_matcher",
        "_number",
        "_pending",
        "_request_ns",
        "_run",
        "_spend",
        "_steered",
        "_structural",
        "_timed",
        "_token_ns",
        "finished",
        "stopped",
    )

    def __init__(
        self,
        matcher: Any,
        eos: int,
        steering: Steering,
        *,
        byte_tokens: bool = False,
        ahead: tuple[int, ...] = (),
        budget: GrammarBudget = NO_BUDGET,
        spend: GrammarSpend | None = None,
    ) -> None:
        """``ahead``: forced tokens ``matcher`` has consumed already (none accepted yet);
        ``budget``: the CPU time its work may take (see ``GrammarBudget``); ``spend``: the
        request's running total, shared with its other choices (None: this matcher's own)."""
        self._matcher = matcher
        self._eos = eos
        self._closing, self._number, self._structural = steering
        # whether token t is byte t (and no token is longer): a forced byte is a forced token
        self._forced_bytes = byte_tokens
        self._pending = NONE  # consumed by ``choose``, returned, not yet accepted
        self._ahead = list(reversed(ahead))  # consumed past the pending one (forced), next last
        self._run = 0  # accepted tokens since the last structural one (for ``choose``)
        self._steered = 0  # ``choose`` calls in a row that could not keep the model's token
        # the grammar ended (its end token was accepted): nothing more may be generated
        self.finished = False
        self.stopped = False  # its text is complete: only EOS may follow
        # the budget in ns (0: none), per token and per request
        self._token_ns = int(budget.per_token_ms * 1e6)
        self._request_ns = int(budget.per_request_ms * 1e6)
        # a token whose work took this long has every later one timed (never without a budget)
        self._heavy_ns = HEAVY_NS if self._token_ns or self._request_ns else 1 << 62
        self._timed = False  # the work is timed in thread CPU time (once it was expensive)
        self._cost_ns = 0  # the current token's work so far (wall time unless timed)
        self._spend = GrammarSpend() if spend is None else spend  # the request's timed work
        self._exceeded: str | None = None  # why the budget gave up on the grammar, if it did

    def mask(self) -> bytes:
        """The allowed next tokens as a bitmask: bit t (byte t // 8, bit t % 8) is token t."""
        start = self._start()
        self._settle()
        mask = bytes(self._matcher.compute_bitmask())
        self._charge(start)
        return mask

    def advance(self, token: int) -> None:
        """Consume ``token`` now, as the model's choice under the mask it was given: it is
        pending (as a token ``choose`` returned), so the ``accept`` that follows costs nothing
        (the runner calls this on the model's thread, after the call; ``accept`` runs on the
        event loop). A token the grammar refuses is not consumed: ``accept`` then says so."""
        if self._exceeded is not None:
            return
        start = self._start()
        self._settle()
        if self._matcher.try_consume_tokens([token]) == 1:
            self._pending = token
        self._charge(start)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar forbids it or llguidance gave up on the
        grammar (see ``refusal``; the matcher is then broken). A matcher in its error state
        still takes EOS (its masks then allow only EOS), so that is checked after the step:
        the request must not end as if its grammar had. ``finished`` then says whether the
        grammar has ended: its EOS was taken. A grammar whose text is complete takes only EOS
        next, so the reply ends one step later on EOS, as under vLLM's grammar backends (a
        stream's last chunk then carries no text, and EOS counts as an output token). False
        too once the work exceeded the budget (``GrammarBudget``)."""
        if self._exceeded is not None:
            return False
        if token == self._pending:  # ``choose`` consumed it already (a consume that succeeded:
            self._pending = NONE  # llguidance's errors make it report failure, so no error)
        else:
            start = self._start()
            self._settle()
            taken = self._matcher.consume_token(token) and not self._matcher.is_error()  # ~40 ns
            self._charge(start)
            if not taken or self._exceeded is not None:
                return False
        self._cost_ns = 0
        self._run = 0 if token in self._structural else self._run + 1
        if not self._ahead:  # (a forced run still ahead: the grammar goes on)
            self.stopped = self._matcher.is_stopped()
            self.finished = self.stopped and token == self._eos
        return True

    def refusal(self, token: int) -> Exception:
        """Why ``accept(token)`` returned False (the matcher is in its error state):
        ``GrammarLimitError`` with llguidance's reason if it gave up on the grammar (one of its
        ``LIMITS`` on the work per token; see ``limit_reason``), else ``ModelOutputError`` (a
        model that broke the mask it was given, or emitted an id outside the vocabulary)."""
        if self._exceeded is not None:
            return GrammarLimitError(self._exceeded)
        message = self._matcher.get_error()
        if any(limit in message for limit in LIMITS):
            return GrammarLimitError(limit_reason(message))
        return ModelOutputError(
            f"the model emitted token {token}, which the request's grammar does not take "
            f"({shorten(message.split('<state>', 1)[0].strip())})"
        )

    def choose(self, preferred: int) -> int:
        """The token a model that cannot apply a mask emits: ``preferred`` while the grammar
        allows it and the current run is short, else the first allowed of EOS and the closing
        tokens, else ``preferred`` if allowed, else the lowest allowed id; after ``RUN_LIMIT``
        such choices in a row, EOS, a closing token every other step, or an allowed token in a
        deterministic rotation (so a cycle of preferences cannot last). It steers toward
        completing the structure. (A token the grammar forces is the only allowed one: every
        rule above returns it.)"""
        if self._ahead and self._pending == NONE:  # a forced token: no parser call, untimed
            return self._offer(preferred)
        start = self._start()
        token = self._choose(preferred)
        self._charge(start)
        return token

    def _choose(self, preferred: int) -> int:
        """``choose`` but for a forced token ahead, untimed."""
        if self._pending != NONE:
            self._settle()  # the pending token was dropped (and the forced run after it)
        looked = self._steered > 0 and self._forced_bytes  # after a refusal, a forced run
        if looked and self._consume_forced():  # often follows: look first (a try saved)
            return self._offer(preferred)
        if self._run < RUN_LIMIT and self._matcher.try_consume_tokens([preferred]) == 1:
            self._pending = preferred
            self._steered = 0
            return preferred
        if self._forced_bytes and not looked and self._consume_forced():
            return self._offer(preferred)
        return self._steer(preferred)

    def _offer(self, preferred: int) -> int:
        """The next forced token (consumed already), counted as ``choose`` counts a token."""
        token = self._pending = self._ahead.pop()
        if token == preferred and self._run < RUN_LIMIT:
            self._steered = 0  # the model's own token, kept
        else:
            self._steered += 1
        return token

    def _steer(self, preferred: int) -> int:
        """``choose`` when ``preferred`` is refused (or the run is too long) and no token is
        forced (or the vocabulary is not one of bytes)."""
        self._steered += 1
        if self._steered <= RUN_LIMIT:  # each candidate tried (and kept) in order: cheaper
            if self._matcher.is_accepting() and self._take(self._eos):  # than a mask for
                return self._eos  # the first few (EOS is allowed where the grammar accepts)
            for token in self._closing:
                if self._take(token):
                    return token
            if self._number is not None and not self._run and self._take(self._number):
                return self._number
            if self._run >= RUN_LIMIT and self._take(preferred):  # (else it was refused above)
                return preferred
        mask = bytes(self._matcher.compute_bitmask())
        if self._steered > RUN_LIMIT:  # the preferences above may cycle (a closing byte that is
            return self._rotate(mask)  # also string content, an alternation): rotate instead
        for index, byte in enumerate(mask):
            if byte:
                return index * 8 + (byte & -byte).bit_length() - 1
        return self._eos  # nothing allowed: the grammar is broken; end the request

    def _take(self, token: int) -> bool:
        """Consume ``token`` (pending), if the grammar allows it."""
        if self._matcher.try_consume_tokens([token]) != 1:
            return False
        self._pending = token
        return True

    def _consume_forced(self) -> bool:
        """Consume the bytes the grammar forces next, if any, into ``_ahead`` (a byte
        vocabulary: each is a token, the only one allowed at its step). If llguidance refused
        its own forced bytes (it never should), the matcher is broken: it then allows only
        EOS, and the request ends with an error."""
        run = consume_forced(self._matcher)
        if run:
            self._ahead = run[::-1]
        return bool(run)

    def _rotate(self, mask: bytes) -> int:
        """EOS if allowed, else (every other call) the first allowed closing token, else an
        allowed token picked by a deterministic rotation. (The closing tokens are tried too:
        a rotation over many allowed tokens may step around the one that ends a string, as in
        an e-mail address's domain, for thousands of tokens.)"""
        if allowed(mask, self._eos):
            return self._eos
        if self._steered & 1:
            for token in self._closing:
                if allowed(mask, token):
                    return token
        ids = [
            i * 8 + bit
            for i, byte in enumerate(mask)
            if byte
            for bit in range(8)
            if byte >> bit & 1
        ]
        return ids[((self._steered * 0x9E3779B1) >> 16) % len(ids)] if ids else self._eos

    def _start(self) -> int:
        """A clock reading before some work: thread CPU time if this token is timed in it."""
        return thread_time_ns() if self._timed else perf_counter_ns()

    def _charge(self, start: int) -> None:
        """Count the work since ``start`` (a ``_start`` reading) against the budget; past it,
        give up on the grammar (``_exceeded``: ``accept`` refuses the token, ``refusal`` says
        why). Untimed work is summed by the wall clock until a token's reaches ``HEAVY_NS``:
        that sum joins the request's total (not checked per token: a thread descheduled on a
        busy machine takes wall time without CPU) and every later call is timed in CPU time."""
        if not self._timed:
            self._cost_ns += perf_counter_ns() - start
            if self._cost_ns < self._heavy_ns:
                return
            self._timed = True
            self._spend.ns += self._cost_ns
            self._cost_ns = 0
        else:
            cost = thread_time_ns() - start
            self._cost_ns += cost
            self._spend.ns += cost
        if self._exceeded is not None:
            return
        if self._token_ns and self._cost_ns > self._token_ns:
            self._exceeded = (
                f"its work for one token took {self._cost_ns / 1e6:.0f} ms of CPU time "
                f"(this server allows {self._token_ns / 1e6:g} ms per token)"
            )
        elif self._request_ns and self._spend.ns > self._request_ns:
            self._exceeded = (
                f"its work took {self._spend.ns / 1e6:.0f} ms of CPU time on this request's "
                f"expensive tokens (this server allows {self._request_ns / 1e6:g} ms per request)"
            )

    def _settle(self) -> None:
        """Roll back the tokens consumed past the accepted ones (a dropped pending token and
        the rest of its forced run)."""
        consumed = (self._pending != NONE) + len(self._ahead)
        if consumed:
            self._matcher.rollback(consumed)
            self._pending = NONE
            self._ahead = []


class GrammarCompiler:
    """Compiles constraints for one tokenizer's vocabulary."""

    def __init__(self, tokenizer: Tokenizer, budget: GrammarBudget = NO_BUDGET) -> None:
        """``budget``: the CPU time each request's grammar work may take."""
        self._vocab = grammar_vocabulary(tokenizer)
        self.budget = budget
        # LRU: compiled grammars, each primed with its start's forced tokens (see ``_prime``)
        self._templates: OrderedDict[Constraint, tuple[Any, tuple[int, ...]]] = OrderedDict()
        self._template_bytes = 0
        self._lock = threading.Lock()  # the LRU: compiles may run on worker threads
        self.vocab_size = tokenizer.vocab_size
        self._eos = tokenizer.eos_token_id
        self._byte_tokens = isinstance(tokenizer, ByteTokenizer)  # token t is byte t (or EOS)
        number = _single_tokens(tokenizer, (NUMBER,))
        self._steering: Steering = (
            _single_tokens(tokenizer, CLOSING),
            number[0] if number else None,
            frozenset(_single_tokens(tokenizer, tuple(STRUCTURAL))),
        )

    def matcher(self, constraint: Constraint, spend: GrammarSpend | None = None) -> GrammarMatcher:
        """A fresh matcher for ``constraint``; ``ConstraintError`` if it does not compile.
        ``spend``: the request's grammar time, shared by its choices (None: its own).

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
            kept = self._templates.get(constraint)
            if kept is not None:
                self._templates.move_to_end(constraint)
        if kept is None:  # compiled outside the lock (it may run on a worker thread)
            template = llguidance.LLMatcher(self._vocab, grammar_text(constraint), log_level=0)
            if template.is_error():
                raise ConstraintError(shorten(template.get_error()))
            kept = (template, self._prime(template))
            self._keep(constraint, kept)
        template, forced = kept
        return GrammarMatcher(
            template.deep_copy(),
            self._eos,
            self._steering,
            byte_tokens=self._byte_tokens,
            ahead=forced,
            budget=self.budget,
            spend=spend,
        )

    def _prime(self, template: Any) -> tuple[int, ...]:
        """With a byte vocabulary, consume the bytes the grammar forces at its start (the
        ``{"name":"`` of a JSON object) into ``template`` once, so that each request's copy
        starts with them ahead instead of computing them (~5 us); they are returned."""
        return tuple(consume_forced(template)) if self._byte_tokens else ()

    def _keep(self, constraint: Constraint, kept: tuple[Any, tuple[int, ...]]) -> None:
        """Cache a compiled grammar, evicting the least recently used past the bounds."""
        with self._lock:
            if constraint in self._templates:
                return
            self._templates[constraint] = kept
            self._template_bytes += len(constraint.source)
            while len(self._templates) > TEMPLATES or self._template_bytes > TEMPLATE_BYTES:
                old, _ = self._templates.popitem(last=False)
                self._template_bytes -= len(old.source)


def consume_forced(matcher: Any) -> list[int]:
    """The bytes the grammar forces next (a byte vocabulary: each a token), consumed by
    ``matcher``; [] if none, or if llguidance refused its own forced bytes (it never should)."""
    forced: list[int] = list(matcher.compute_ff_bytes())
    # (one call: half the cost of a checked ``try_consume_tokens``, a quarter of a call per token)
    return forced if forced and matcher.consume_tokens(forced) else []


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
