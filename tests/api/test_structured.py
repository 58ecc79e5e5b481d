"""Structured outputs in the engine: a constrained request's tokens always obey its grammar,
with the mocks (which cannot apply a mask: the runner steers their tokens) and with a model that
samples under the mask, also when requests are preempted between any two steps."""

from __future__ import annotations

import gc
import json
import random
import time
import weakref
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from app.engine.runner import make_runner
from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.types import RequestStatus, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import Model, StepBatch
from app.models.tokenizer import EOS_TOKEN_ID, ByteTokenizer
from app.structured import grammar
from app.structured.constraint import Constraint, ConstraintError
from app.structured.grammar import GrammarCompiler, allowed

TOKENIZER = ByteTokenizer()
COMPILER = GrammarCompiler(TOKENIZER)
STOPS = frozenset({EOS_TOKEN_ID})


class MaskedRandomModel:
    """A cached model that applies masks: it samples uniformly among each row's allowed tokens
    (any token when unmasked), seeded, and records every mask it was given."""

    applies_token_masks = True
    blocking = False

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.masked_rows = 0

    def step(self, batch: StepBatch) -> list[int]:
        masks = list(batch.token_masks) or [None] * batch.num_outputs
        out = []
        for mask in masks:
            if mask is None:
                out.append(self.rng.randrange(TOKENIZER.vocab_size))
                continue
            self.masked_rows += 1
            ids = [t for t in range(TOKENIZER.vocab_size) if allowed(mask, t)]
            out.append(self.rng.choice(ids))
        return out

    def release(self, slot: int) -> None:
        pass


def drive(
    model: Model,
    seqs: list[Sequence],
    num_slots: int,
    *,
    kv_cache_tokens: int | None = None,
    preempt: random.Random | None = None,
    constraints: dict[str, Constraint] | None = None,
) -> Scheduler:
    """Runs ``seqs`` to completion (when ``preempt`` is given, preempting a random running
    request between steps, and one of the step's requests during the model call, whose token is
    then dropped) and returns the scheduler."""
    config = SchedulerConfig(num_slots=num_slots, kv_cache_tokens=kv_cache_tokens, block_size=4)
    constraints = constraints or {}
    scheduler = Scheduler(config)
    runner = make_runner(model, num_slots)
    now = time.monotonic()
    for seq in seqs:
        scheduler.add(seq, now)
    steps = 0
    while scheduler.has_work():
        steps += 1
        assert steps < 20_000, "the requests never finished"
        if preempt is not None and preempt.random() < 0.3:
            running = [s for s in seqs if s.status is RequestStatus.RUNNING]
            if running:
                scheduler.preempt(preempt.choice(running), now)
        out = scheduler.schedule(now)
        if out.empty:
            continue
        result = runner.execute(out)
        if preempt is not None and preempt.random() < 0.2:  # during the call: its token drops
            running = [s for s in out.scheduled() if s.status is RequestStatus.RUNNING]
            if running:
                scheduler.preempt(preempt.choice(running), now)
        scheduler.update(out, result, now)
        if preempt is not None:
            for seq in seqs:  # every live grammar stands after exactly its accepted tokens
                if seq.constraint is not None and seq.request_id in constraints:
                    fresh = COMPILER.matcher(constraints[seq.request_id])
                    assert all(fresh.accept(t) for t in seq.generated)
                    assert seq.constraint.mask() == fresh.mask(), seq.request_id
    runner.close()
    return scheduler


def constrained(rid: str, prompt: bytes, constraint: Constraint, max_tokens: int) -> Sequence:
    seq = Sequence(rid, list(prompt), max_tokens, STOPS)
    seq.constraint = COMPILER.matcher(constraint)
    return seq


def replays(constraint: Constraint, tokens: list[int]) -> bool:
    """Whether a fresh matcher accepts exactly these tokens, in order."""
    matcher = COMPILER.matcher(constraint)
    return all(matcher.accept(t) for t in tokens)


# --- random JSON schemas ---------------------------------------------------------------------

NAMES = st.text(alphabet="abcdefghijklmnop_", min_size=1, max_size=8)
LEAVES = st.one_of(
    st.just({"type": "string"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
    st.just({"type": "integer"}),
    st.builds(
        lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 50}, st.integers(-99, 99)
    ),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(NAMES, min_size=1, max_size=4, unique=True)),
    st.builds(
        lambda p: {"type": "string", "pattern": p},
        st.sampled_from(["^[a-z]{2,5}$", "^\\d+-\\d+$", "^(foo|bar)+baz$", "^[A-Z]{3}-[0-9]{4}$"]),
    ),
    st.builds(
        lambda f: {"type": "string", "format": f},
        st.sampled_from(["email", "date-time", "uuid", "date"]),
    ),
    st.builds(lambda n: {"type": "string", "minLength": n}, st.integers(1, 60)),
)


def _object(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n},
            inner,
            st.integers(0, 3),
        ),
        st.builds(
            lambda items, n: {"type": "array", "items": items, "minItems": n, "maxItems": n + 1},
            inner,
            st.integers(1, 3),
        ),
        st.builds(_object, st.dictionaries(NAMES, inner, min_size=1, max_size=4)),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=2, max_size=2)),
    ),
    max_leaves=8,
)


EMAIL_ITEMS = {  # the steering's rotation once stepped around the quote that ends an e-mail
    "type": "array",  # address (for 2,000 tokens): closing tokens are tried every other step
    "items": _object({"__": {"type": "string"}, "_": {"type": "string", "format": "email"}}),
    "minItems": 3,
    "maxItems": 4,
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schema=SCHEMAS,
    seed=st.integers(0, 2**16),
    cached=st.booleans(),
    prompt=st.binary(min_size=1, max_size=12),
)
@example(schema=EMAIL_ITEMS, seed=0, cached=False, prompt=b"\x00")
def test_every_mock_output_validates_against_its_random_schema(
    schema: dict[str, Any], seed: int, cached: bool, prompt: bytes
) -> None:
    language = MockLanguage(seed=seed)
    model: Model = CachedMockModel(2, language) if cached else MockModel(language)
    constraint = Constraint.json_schema(schema)
    seqs = [constrained(f"r{i}", prompt + bytes([i]), constraint, 2000) for i in range(2)]
    drive(model, seqs, num_slots=2)
    for seq in seqs:
        assert seq.finish_reason == "stop", (seq.finish_reason, TOKENIZER.decode(seq.generated))
        text = TOKENIZER.decode(seq.generated)
        jsonschema.validate(json.loads(text), schema)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), cached=st.booleans(), masked=st.booleans())
def test_a_constrained_request_under_preemption_never_gets_a_forbidden_token(
    seed: int, cached: bool, masked: bool
) -> None:
    properties = {
        "a": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "b": {"type": "string", "maxLength": 8},
    }
    schema = _object(properties)
    kinds = [Constraint.json_schema(schema), Constraint.regex("[a-c]{3,9}x"), None]
    model: Model
    if masked:
        model = MaskedRandomModel(seed)
    elif cached:
        model = CachedMockModel(3, MockLanguage(seed=seed))
    else:
        model = MockModel(MockLanguage(seed=seed))
    seqs = []
    for i in range(6):
        kind = kinds[i % 3]
        if kind is None:
            seqs.append(Sequence(f"free{i}", [65 + i, 66], 12, STOPS))
        else:
            seqs.append(constrained(f"c{i}", bytes([65 + i, 66]), kind, 60))
    constraints = {f"c{i}": kind for i in range(6) if (kind := kinds[i % 3]) is not None}
    scheduler = drive(
        model, seqs, 3, kv_cache_tokens=96, preempt=random.Random(seed), constraints=constraints
    )
    assert sum(s.num_preemptions for s in seqs) > 0
    for i, seq in enumerate(seqs):
        kind = kinds[i % 3]
        assert seq.finish_reason in ("stop", "length"), seq.error
        assert seq.constraint is None  # freed with the request
        if kind is None:
            continue
        assert replays(
            kind, seq.generated + ([EOS_TOKEN_ID] if seq.finish_reason == "stop" else [])
        )
    assert not scheduler.has_work()


def test_a_grammar_that_cannot_end_within_max_tokens_ends_with_length() -> None:
    seq = constrained("r", b"hi", Constraint.regex("[a-z]{50}"), 10)
    drive(MockModel(MockLanguage()), [seq], num_slots=1)
    assert seq.finish_reason == "length" and seq.num_generated == 10


def test_a_complete_grammar_ends_the_request_on_eos_one_step_later() -> None:
    """As vLLM's grammar backends: a grammar whose text is complete takes only EOS, and the
    request ends on it (a stream's last chunk then carries no text, as vLLM's does)."""
    seq = constrained("r", b"hi", Constraint.regex("[a-z]{5}"), 10)
    drive(MockModel(MockLanguage()), [seq], num_slots=1)
    assert seq.finish_reason == "stop" and seq.stop_token == EOS_TOKEN_ID
    assert len(TOKENIZER.decode(seq.generated)) == 5


def test_an_ended_constrained_request_frees_its_grammar() -> None:
    """Aborted while running (after the runner has seen it) or finished: no reference to its
    matcher is left anywhere (scheduler, runner, sequence), so the matcher is collected."""
    scheduler = Scheduler(SchedulerConfig(num_slots=2))
    runner = make_runner(CachedMockModel(2, MockLanguage()), 2)
    aborted = constrained("a", b"hi", Constraint.json_object(), 100)
    done = constrained("d", b"hi", Constraint.regex("[a-z]{3}"), 100)
    refs = [weakref.ref(seq.constraint) for seq in (aborted, done)]
    for seq in (aborted, done):
        scheduler.add(seq, 0.0)
    for _ in range(3):
        out = scheduler.schedule(0.0)
        scheduler.update(out, runner.execute(out), 0.0)
    scheduler.abort("a", 0.0)
    while scheduler.has_work():
        out = scheduler.schedule(0.0)
        scheduler.update(out, runner.execute(out), 0.0)
    gc.collect()
    assert (aborted.finish_reason, done.finish_reason) == ("abort", "stop")
    assert [ref() for ref in refs] == [None, None]


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint.json_schema({"type": "foo"}), "Invalid type: foo"),
        (Constraint.json_schema({"type": "string", "format": "weird"}), "Unknown format: weird"),
        (Constraint.regex("a(b"), "unclosed group"),
        (Constraint.grammar("start: missing_rule"), "unknown name"),
    ],
)
def test_a_constraint_that_does_not_compile_says_why(constraint: Constraint, message: str) -> None:
    with pytest.raises(ConstraintError, match=message):
        COMPILER.matcher(constraint)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (Constraint.choice(["positive", "negative"]), lambda t: t in ("positive", "negative")),
        (Constraint.regex(r"[a-z]+@[a-z]+\.com"), lambda t: t.endswith(".com") and "@" in t),
        (Constraint.grammar('root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),
        (Constraint.json_object(), lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_the_mock_obeys_each_kind_of_constraint(constraint: Constraint, check: Any) -> None:
    seq = constrained("r", b"user: hi\nassistant: ", constraint, 300)
    drive(MockModel(MockLanguage()), [seq], num_slots=1)
    text = TOKENIZER.decode(seq.generated)
    assert seq.finish_reason == "stop" and check(text), text


def test_a_choice_of_thousands_of_options_is_answered_with_one_of_them() -> None:
    """Review finding: a Lark alternation of 3000 options broke llguidance's row limit at the
    first token (the request failed as a model error); one regex lexeme scales."""
    options = [f"w{i:05d}" for i in range(3000)] + ["a.b (c)|d", "x-y~z#&"]
    seq = constrained("r", b"pick: ", Constraint.choice(options), 20)
    drive(MockModel(MockLanguage()), [seq], num_slots=1)
    assert seq.finish_reason == "stop" and TOKENIZER.decode(seq.generated) in options
    for option in ("a.b (c)|d", "x-y~z#&"):
        assert replays(Constraint.choice(options), [*option.encode(), EOS_TOKEN_ID])


def test_a_constraint_too_large_to_compile_quickly_is_refused() -> None:
    with pytest.raises(ConstraintError, match="too large"):
        COMPILER.matcher(Constraint.choice([f"option {i}" for i in range(8000)]))


def test_the_compiled_grammar_cache_is_bounded_by_its_sources_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(grammar, "TEMPLATE_BYTES", 50_000)
    compiler = GrammarCompiler(TOKENIZER)
    for i in range(12):  # 12 distinct ~10 KB schemas: past the (lowered) 50 KB budget
        props = {f"p{i}_{k:04d}": {"type": "integer"} for k in range(300)}
        compiler.matcher(Constraint.json_schema({"type": "object", "properties": props}))
        assert compiler._template_bytes <= 50_000
    assert 0 < len(compiler._templates) < 12


class ReferenceChooser:
    """``GrammarMatcher.choose``'s rules as plainly as they read: the mask first, every step
    (the matcher is only asked for masks and fed accepted tokens)."""

    def __init__(self, constraint: Constraint) -> None:
        self.matcher = COMPILER.matcher(constraint)
        self.run = self.steered = 0

    def choose(self, preferred: int) -> int:
        mask = self.matcher.mask()
        ids = [t for t in range(TOKENIZER.vocab_size) if allowed(mask, t)]
        if self.run < grammar.RUN_LIMIT and preferred in ids:
            self.steered = 0
            return preferred
        self.steered += 1
        if self.steered > grammar.RUN_LIMIT:
            if EOS_TOKEN_ID in ids or not ids:
                return EOS_TOKEN_ID
            closing = [t for t in map(ord, grammar.CLOSING) if t in ids]
            if self.steered % 2 and closing:
                return closing[0]
            return ids[((self.steered * 0x9E3779B1) >> 16) % len(ids)]
        for token in (EOS_TOKEN_ID, *map(ord, grammar.CLOSING)):
            if token in ids:
                return token
        if ord(grammar.NUMBER) in ids and not self.run:
            return ord(grammar.NUMBER)
        if preferred in ids or not ids:
            return preferred if ids else EOS_TOKEN_ID
        return ids[0]

    def accept(self, token: int) -> bool:
        self.run = 0 if chr(token) in grammar.STRUCTURAL and token < 256 else self.run + 1
        return self.matcher.accept(token)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    constraint=SCHEMAS.map(Constraint.json_schema)
    | st.sampled_from(["abc", "(foo|bar)+baz", "x[0-9]{2}y", "[a-c]{3,9}x"]).map(Constraint.regex),
    preferences=st.lists(
        st.tuples(st.sampled_from([*b'abz09 -.:,"{}[]\\e\x00', EOS_TOKEN_ID]), st.booleans()),
        min_size=1,
        max_size=300,
    ),
    run_limit=st.sampled_from([1, 3, grammar.RUN_LIMIT]),
)
def test_the_mocks_choices_follow_the_plain_rules_also_when_tokens_are_dropped(
    constraint: Constraint, preferences: list[tuple[int, bool]], run_limit: int
) -> None:
    """The matcher consumes its choice (and a whole forced run) ahead of ``accept``: its
    choices are still the plain rules' (a mask each step), also when an offered token is
    dropped (preempted during the call) and the next call comes back to an earlier state.
    (Short run limits make the rotation's counting matter.)"""
    saved, grammar.RUN_LIMIT = grammar.RUN_LIMIT, run_limit
    try:
        check_choices(constraint, preferences)
    finally:
        grammar.RUN_LIMIT = saved


def check_choices(constraint: Constraint, preferences: list[tuple[int, bool]]) -> None:
    matcher, reference = COMPILER.matcher(constraint), ReferenceChooser(constraint)
    for preferred, dropped in preferences:
        token = matcher.choose(preferred)
        assert token == reference.choose(preferred)
        if dropped:
            continue
        assert matcher.accept(token) and reference.accept(token)
        assert matcher.finished == reference.matcher.finished
        if matcher.finished:
            break
    assert matcher.mask() == reference.matcher.mask()
