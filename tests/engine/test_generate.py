"""The seed's contract: ``from app import Request, generate, MockModel``.

Every result is checked against a plain sequential reference that runs each request alone, so
the batching, slot refilling and padding can change nothing a caller sees.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import run_alone

from app import CachedMockModel, MockModel, ModelError, ModelOutputError, Request, generate
from app.models.cached_mock import SlotReuseError
from app.models.mock_language import MockLanguage
from app.models.protocol import DEFAULT_SAMPLING, PrefillChunk, StepBatch, returns_int_tokens

FAST = settings(max_examples=40, deadline=None)


def reference(
    model: object, requests: list[Request], stop_token: int, include_stop: bool = False
) -> dict[str, list[int]]:
    """Each request alone: one ``next_tokens([prefix])`` call per token."""
    return {
        r.request_id: run_alone(model, r.prompt, r.max_tokens, stop_token, include_stop)  # type: ignore[arg-type]
        for r in requests
    }


class HashModel:
    """Next token = a deterministic hash of the whole prefix, modulo ``vocab``."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        return [hash(tuple(prefix)) % self.vocab for prefix in batch]


class RecordingModel:
    """Wraps a model and keeps a copy of every call's batch (and the ids of its lists)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls: list[list[list[int]]] = []
        self.list_ids: list[list[int]] = []

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        self.calls.append([list(prefix) for prefix in batch])
        self.list_ids.append([id(prefix) for prefix in batch])
        return self.inner.next_tokens(batch)  # type: ignore[attr-defined,no-any-return]


@st.composite
def workloads(draw: st.DrawFn, vocab: int, max_tokens: int = 12) -> tuple[list[Request], int]:
    """A list of requests with unique ids, and a number of slots in 1..n+2."""
    n = draw(st.integers(0, 7))
    requests = [
        Request(
            request_id=f"r{i}",
            prompt=draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6)),
            max_tokens=draw(st.integers(0, max_tokens)),
        )
        for i in range(n)
    ]
    return requests, draw(st.integers(1, n + 2))


# --- equal to the sequential reference -----------------------------------------------------


@FAST
@given(data=st.data(), vocab=st.integers(2, 12), include_stop=st.booleans())
def test_hash_model_matches_reference(data: st.DataObject, vocab: int, include_stop: bool) -> None:
    requests, num_slots = data.draw(workloads(vocab))
    stop_token = data.draw(st.integers(0, vocab - 1))
    model = HashModel(vocab)
    got = generate(model, requests, num_slots, stop_token, include_stop=include_stop)
    assert got == reference(model, requests, stop_token, include_stop)
    assert list(got) == [r.request_id for r in requests]


@FAST
@given(data=st.data())
def test_mock_model_text_mode_matches_reference(data: st.DataObject) -> None:
    requests, num_slots = data.draw(workloads(vocab=256, max_tokens=40))
    model = MockModel()
    got = generate(model, requests, num_slots, model.stop_token)
    assert got == reference(MockModel(), requests, model.stop_token)


@FAST
@given(data=st.data())
def test_mock_model_random_mode_matches_reference(data: st.DataObject) -> None:
    language = MockLanguage(text=False, vocab_size=50, stop_token=7)
    requests, num_slots = data.draw(workloads(vocab=50, max_tokens=20))
    got = generate(MockModel(language), requests, num_slots, 7)
    assert got == reference(MockModel(language), requests, 7)


@FAST
@given(data=st.data())
def test_cached_mock_model_matches_mock_model(data: st.DataObject) -> None:
    language = MockLanguage(text=False, vocab_size=30, stop_token=3, stop_probability=0.1)
    requests, num_slots = data.draw(workloads(vocab=30))
    cached = generate(CachedMockModel(num_slots, language), requests, num_slots, 3)
    assert cached == generate(MockModel(language), requests, num_slots, 3)
    assert cached == reference(MockModel(language), requests, 3)


def test_no_requests_means_no_model_call() -> None:
    model = RecordingModel(HashModel(5))
    assert generate(model, [], 3, 0) == {}
    assert model.calls == []


def test_prompts_are_not_modified() -> None:
    requests = [Request("a", [1, 2, 3], 5), Request("b", [4], 5)]
    generate(HashModel(50), requests, 1, 999)
    assert [r.prompt for r in requests] == [[1, 2, 3], [4]]


# --- what the model sees ----------------------------------------------------------------------

TAG = 1000  # prompts start with TAG + index, so a batch entry names its request


def tagged(max_tokens: list[int]) -> list[Request]:
    return [Request(f"r{i}", [TAG + i, i % 3], m) for i, m in enumerate(max_tokens)]


@FAST
@given(
    max_tokens=st.lists(st.integers(0, 10), max_size=8),
    extra_slots=st.integers(0, 9),
    stop_token=st.integers(0, 9),
    include_stop=st.booleans(),
)
def test_every_call_is_as_full_as_possible_and_in_order(
    max_tokens: list[int], extra_slots: int, stop_token: int, include_stop: bool
) -> None:
    requests = tagged(max_tokens)
    num_slots = 1 + extra_slots % (len(requests) + 2)
    model = RecordingModel(HashModel(10))
    got = generate(model, requests, num_slots, stop_token, include_stop=include_stop)
    assert got == reference(HashModel(10), requests, stop_token, include_stop)

    calls_of: dict[int, list[int]] = {}  # request index -> the calls it was in
    for k, call in enumerate(model.calls):
        assert 1 <= len(call) <= num_slots
        for entry in call:
            calls_of.setdefault(entry[0] - TAG, []).append(k)
    runnable = [i for i, r in enumerate(requests) if r.max_tokens > 0]
    # A max_tokens == 0 request is never sent to the model and yields [].
    assert sorted(calls_of) == runnable
    assert all(got[r.request_id] == [] for r in requests if r.max_tokens == 0)
    for k, call in enumerate(model.calls):
        unfinished = sum(1 for i in runnable if calls_of[i][-1] >= k)
        assert len(call) == min(num_slots, unfinished)
        for entry in call:
            request = requests[entry[0] - TAG]
            # prompt + the tokens generated so far, never anything else
            done = len(entry) - len(request.prompt)
            assert entry == request.prompt + got[request.request_id][:done]
    for i in runnable:  # once admitted, a request is in every call until it ends
        assert calls_of[i] == list(range(calls_of[i][0], calls_of[i][-1] + 1))
    # Admission in the order of `requests`.
    firsts = [calls_of[i][0] for i in runnable]
    assert firsts == sorted(firsts)


class ScriptedModel:
    """Returns ``script[len(prefix) - len(prompt)]``: the i-th generated token is script[i]."""

    def __init__(self, prompt_len: int, script: list[int]) -> None:
        self.prompt_len, self.script = prompt_len, script

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        return [self.script[len(p) - self.prompt_len] for p in batch]


def test_stop_token_excluded_by_default_and_included_on_request() -> None:
    model = ScriptedModel(1, [5, 6, 0, 8, 9])
    requests = [Request("a", [1], 10)]
    assert generate(model, requests, 2, 0) == {"a": [5, 6]}
    assert generate(model, requests, 2, 0, include_stop=True) == {"a": [5, 6, 0]}


def test_max_tokens_counts_generated_tokens_only() -> None:
    model = ScriptedModel(3, [5, 6, 7, 8])
    assert generate(model, [Request("a", [1, 2, 3], 2)], 1, 0) == {"a": [5, 6]}


def test_stop_token_on_the_last_allowed_token_still_stops() -> None:
    model = ScriptedModel(1, [5, 0, 8])
    assert generate(model, [Request("a", [1], 2)], 1, 0, include_stop=True) == {"a": [5, 0]}


def test_slot_freed_in_a_step_is_refilled_before_the_next_call() -> None:
    model = RecordingModel(ScriptedModel(2, [1, 2, 3, 4]))
    requests = [
        Request("a", [TAG, 0], 1),
        Request("b", [TAG + 1, 0], 3),
        Request("c", [TAG + 2, 0], 2),
    ]
    generate(model, requests, 2, 99)
    heads = [[entry[0] - TAG for entry in call] for call in model.calls]
    # a ends after call 0; c takes its slot 0 at call 1. A step feeds the decoding requests
    # first (slot order), then the prompts that complete in it.
    assert heads == [[0, 1], [1, 2], [2, 1]]


# --- fixed batch shape ------------------------------------------------------------------------

PAD = [4242]


class PadTrapModel:
    """Answers the pad sequence with the stop token (or junk): it must be ignored."""

    def __init__(self, inner: object, stop_token: int) -> None:
        self.inner, self.stop_token = inner, stop_token
        self.sizes: list[int] = []

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        self.sizes.append(len(batch))
        out = self.inner.next_tokens(batch)  # type: ignore[attr-defined]
        return [self.stop_token if p == PAD else t for p, t in zip(batch, out, strict=True)]


@FAST
@given(data=st.data(), vocab=st.integers(2, 12))
def test_padded_calls_have_num_slots_entries_and_same_results(
    data: st.DataObject, vocab: int
) -> None:
    requests, num_slots = data.draw(workloads(vocab))
    stop_token = data.draw(st.integers(0, vocab - 1))
    model = PadTrapModel(HashModel(vocab), stop_token)
    padded = generate(model, requests, num_slots, stop_token, pad_sequence=PAD)
    assert all(size == num_slots for size in model.sizes)
    assert padded == generate(HashModel(vocab), requests, num_slots, stop_token)


def test_pad_sequence_with_a_cached_model_is_refused() -> None:
    with pytest.raises(ValueError, match="pad_sequence"):
        generate(CachedMockModel(2), [Request("a", [1], 3)], 2, 256, pad_sequence=PAD)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requests", "num_slots", "match"),
    [
        ([Request("a", [1], 2), Request("b", [2], 2), Request("a", [3], 2)], 2, "'a'.*duplicate"),
        ([Request("ok", [1], 2), Request("neg", [1], -1)], 2, "'neg'.*max_tokens"),
        ([Request("ok", [1], 2), Request("empty", [], 2)], 2, "'empty'.*prompt"),
        ([Request("ok", [1], 2), Request("tup", (1, 2), 2)], 2, "'tup'.*prompt"),  # type: ignore[arg-type]
        ([Request("bool", [1, True], 2)], 2, "'bool'.*True"),
        ([Request("float", [1, 2.0], 2)], 2, "'float'.*2.0"),  # type: ignore[list-item]
        ([Request("str", ["1"], 2)], 2, "'str'.*'1'"),  # type: ignore[list-item]
        ([Request("none", [None], 2)], 2, "'none'.*None"),  # type: ignore[list-item]
        ([Request("mt", [1], 2.0)], 2, "'mt'.*max_tokens"),  # type: ignore[arg-type]
        ([Request("a", [1], 2)], 0, "num_slots"),
        ([Request("a", [1], 2)], -3, "num_slots"),
        ([Request("a", [1], 2)], True, "num_slots"),
    ],
)
def test_bad_input_raises_value_error_before_any_model_call(
    requests: list[Request], num_slots: int, match: str
) -> None:
    model = RecordingModel(HashModel(5))
    with pytest.raises(ValueError, match=match):
        generate(model, requests, num_slots, 0)
    assert model.calls == []


def test_non_integer_stop_token_is_refused() -> None:
    model = RecordingModel(HashModel(5))
    with pytest.raises(ValueError, match="stop_token"):
        generate(model, [Request("a", [1], 2)], 1, "0")  # type: ignore[arg-type]
    assert model.calls == []


# --- the model's contract ---------------------------------------------------------------------


class BrokenOutputModel:
    def __init__(self, output: object, on_call: int = 0) -> None:
        self.output, self.on_call, self.calls = output, on_call, 0

    def next_tokens(self, batch: list[list[int]]) -> object:
        self.calls += 1
        if self.calls - 1 == self.on_call:
            return self.output
        return [1] * len(batch)


@pytest.mark.parametrize(
    ("output", "expected_words"),
    [
        ([1], ["1 tokens", "expected 2"]),
        ([1, 2, 3], ["3 tokens", "expected 2"]),
        ([], ["0 tokens", "expected 2"]),
        ([1, 2.0], ["2.0", "float", "expected int"]),
        ([1, "2"], ["'2'", "str", "expected int"]),
        ([True, 2], ["True", "bool", "expected int"]),
        ([1, None], ["None", "expected int"]),
        (None, ["NoneType", "expected a list"]),
        ({1: 1, 2: 2}, ["dict", "expected a list"]),
    ],
)
def test_contract_violation_is_model_output_error(
    output: object, expected_words: list[str]
) -> None:
    requests = [Request("a", [1], 5), Request("b", [2], 5), Request("c", [3], 5)]
    model = BrokenOutputModel(output, on_call=2)
    with pytest.raises(ModelOutputError) as info:
        generate(model, requests, 2, 0)  # type: ignore[arg-type]
    assert not isinstance(info.value, ValueError)
    for words in expected_words:
        assert words in str(info.value)
    # two good calls happened before the bad one; c never started
    assert info.value.partial == {"a": [1, 1], "b": [1, 1], "c": []}


class BoolMock(MockModel):
    """A built-in mock's subclass that redefines its token method (and breaks the contract)."""

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        return [True for _ in batch]


class BoolCachedMock(CachedMockModel):
    def step(self, batch: StepBatch) -> list[int]:
        return [float(token) for token in super().step(batch)]  # type: ignore[misc]


@pytest.mark.parametrize("model", [BoolMock(), BoolCachedMock(1)])
def test_a_subclass_that_redefines_a_token_method_is_type_checked(model: object) -> None:
    """The built-in models promise int tokens (``returns_int_tokens``: the runner then checks
    only their count); a subclass's own token method is not covered by that promise."""
    with pytest.raises(ModelOutputError, match="expected int"):
        generate(model, [Request("a", [1], 3)], 1, 0)  # type: ignore[arg-type]


def test_the_built_in_models_promise_int_tokens_and_keep_it() -> None:
    class Renamed(MockModel):  # no token method of its own: the promise holds
        pass

    class Promising(BoolMock):
        returns_int_tokens = True

    for model in (MockModel(), CachedMockModel(1), Renamed()):
        assert returns_int_tokens(model)
    assert not returns_int_tokens(BoolMock()) and returns_int_tokens(Promising())
    tokens = generate(CachedMockModel(1), [Request("a", [1, 2], 4)], 1, -1)["a"]
    assert len(tokens) == 4 and {type(t) for t in tokens} == {int}


def test_tuple_output_is_accepted() -> None:
    class TupleModel:
        def next_tokens(self, batch: list[list[int]]) -> tuple[int, ...]:
            return tuple(5 for _ in batch)

    assert generate(TupleModel(), [Request("a", [1], 2)], 1, 0) == {"a": [5, 5]}  # type: ignore[arg-type]


class FailingModel:
    def __init__(self, inner: object, fail_on: int) -> None:
        self.inner, self.fail_on, self.calls = inner, fail_on, 0

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        self.calls += 1
        if self.calls - 1 == self.fail_on:
            raise KeyError("device lost")
        return self.inner.next_tokens(batch)  # type: ignore[attr-defined,no-any-return]


@FAST
@given(data=st.data(), vocab=st.integers(2, 12), fail_on=st.integers(0, 15))
def test_model_exception_is_model_error_with_partial_prefixes(
    data: st.DataObject, vocab: int, fail_on: int
) -> None:
    requests, num_slots = data.draw(workloads(vocab))
    stop_token = data.draw(st.integers(0, vocab - 1))
    model = FailingModel(HashModel(vocab), fail_on)
    expected = reference(HashModel(vocab), requests, stop_token)
    try:
        got = generate(model, requests, num_slots, stop_token)
    except ModelError as err:
        assert type(err) is ModelError
        assert isinstance(err.__cause__, KeyError)
        assert "device lost" in str(err)
        assert model.calls == fail_on + 1
        assert list(err.partial) == [r.request_id for r in requests]
        for rid, tokens in err.partial.items():
            assert tokens == expected[rid][: len(tokens)]
    else:
        assert model.calls <= fail_on  # the failing call was never reached
        assert got == expected


def test_model_error_partial_reports_progress_of_every_request() -> None:
    requests = [
        Request("a", [1], 1),
        Request("b", [2], 9),
        Request("c", [3], 9),
        Request("z", [4], 0),
    ]
    model = FailingModel(ScriptedModel(1, [7] * 10), fail_on=3)
    with pytest.raises(ModelError) as info:
        generate(model, requests, 2, 0)
    # a: done after 1 step; b: 3 tokens; c admitted at step 1: 2 tokens; z never runs.
    assert info.value.partial == {"a": [7], "b": [7, 7, 7], "c": [7, 7], "z": []}


# --- cached model -----------------------------------------------------------------------------


def fresh_prefill(slot: int, tokens: list[int]) -> StepBatch:
    chunk = PrefillChunk(slot, tokens, 0, True, DEFAULT_SAMPLING, f"r{slot}")
    return StepBatch([], [], [], [], [chunk])


def test_cached_mock_refuses_a_slot_assigned_twice_without_release() -> None:
    model = CachedMockModel(2)
    model.step(fresh_prefill(0, [1, 2]))
    with pytest.raises(SlotReuseError):
        model.step(fresh_prefill(0, [3]))
    model.release(0)
    model.step(fresh_prefill(0, [3]))  # fine once released


def test_cached_model_through_generate_reuses_slots_correctly() -> None:
    """More requests than slots: every slot is released and reassigned several times."""
    requests = [Request(f"r{i}", [i, i + 1], 3 + i % 4) for i in range(12)]
    got = generate(CachedMockModel(2), requests, 2, 256)
    assert got == reference(MockModel(), requests, 256)


def test_generate_releases_every_slot_so_a_cached_model_can_serve_again() -> None:
    """Found in review: the slots still assigned when the last request finished were never
    released, so a second generate() on the same model failed with SlotReuseError."""
    model = CachedMockModel(2)
    requests = [Request(f"r{i}", [i, i + 1], 3) for i in range(3)]
    first = generate(model, requests, 2, 256)
    assert generate(model, requests, 2, 256) == first
    assert model.held_slots() == []


def test_generate_releases_every_slot_after_a_model_error() -> None:
    model = FailingCachedModel(fail_at_call=2)
    with pytest.raises(ModelError):
        generate(model, [Request("a", [1], 5), Request("b", [2], 5)], 2, 256)
    assert model.held_slots() == []


class FailingCachedModel(CachedMockModel):
    """A cached mock whose step fails on one call."""

    def __init__(self, fail_at_call: int) -> None:
        super().__init__(2)
        self.calls, self.fail_at_call = 0, fail_at_call

    def step(self, batch: StepBatch) -> list[int]:
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise RuntimeError("device lost")
        return super().step(batch)


# --- per-token cost ---------------------------------------------------------------------------


def test_each_request_is_passed_as_the_same_list_every_step() -> None:
    """The prefix is appended in place, never rebuilt: a step costs O(1) per sequence in the
    engine however long the prompt is."""
    requests = [Request(f"r{i}", [TAG + i, *range(200 * i)], 8) for i in range(5)]
    model = RecordingModel(HashModel(1000))
    generate(model, requests, 2, 999)
    ids_of: dict[int, set[int]] = {}
    for call, ids in zip(model.calls, model.list_ids, strict=True):
        for entry, list_id in zip(call, ids, strict=True):
            ids_of.setdefault(entry[0], set()).add(list_id)
    assert len(ids_of) == 5
    assert all(len(ids) == 1 for ids in ids_of.values())
    assert all(id(r.prompt) not in ids_of[r.prompt[0]] for r in requests)  # caller's list untouched
