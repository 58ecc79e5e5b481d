"""The mock models: determinism, the text they write, stop rates and the KV-cache contract. (The
simulated step time is the engine's step clock: see test_engine.)"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app import MockModel, Request, generate
from app.models.cached_mock import CachedMockModel, SlotReuseError
from app.models.mock_language import WORDS, MockLanguage
from app.models.protocol import (
    DEFAULT_SAMPLING,
    CachedModel,
    PrefillChunk,
    StatelessModel,
    StepBatch,
)
from app.models.tokenizer import ByteTokenizer

FAST = settings(max_examples=50, deadline=None)
prefixes = st.lists(st.integers(0, 256), min_size=1, max_size=40)


def text_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = ["hello", "tell", "me", "about", "the", "sea", "why", "Write", "a", "story"]
    return [list(" ".join(rng.choices(words, k=rng.randint(1, 6))).encode()) for _ in range(n)]


# --- determinism ------------------------------------------------------------------------------


@FAST
@given(batch=st.lists(prefixes, min_size=1, max_size=6), seed=st.integers(0, 3))
def test_same_prefix_same_token_across_instances_and_batch_positions(
    batch: list[list[int]], seed: int
) -> None:
    alone = [MockModel(seed=seed).next_tokens([prefix])[0] for prefix in batch]
    assert MockModel(seed=seed).next_tokens(batch) == alone
    assert MockModel(seed=seed).next_tokens(batch[::-1]) == alone[::-1]


@FAST
@given(batch=st.lists(prefixes, min_size=1, max_size=6))
def test_next_tokens_does_not_modify_its_input(batch: list[list[int]]) -> None:
    copy = [list(prefix) for prefix in batch]
    MockModel().next_tokens(batch)
    assert batch == copy


def test_different_seeds_give_different_outputs() -> None:
    requests = [Request(f"r{i}", prompt, 30) for i, prompt in enumerate(text_prompts(10))]
    assert generate(MockModel(seed=1), requests, 4, 256) != generate(
        MockModel(seed=2), requests, 4, 256
    )


def test_models_implement_their_protocols() -> None:
    assert isinstance(MockModel(), StatelessModel)
    assert isinstance(CachedMockModel(2), CachedModel)
    assert MockModel().stop_token == CachedMockModel(1).stop_token == 256


# --- text mode --------------------------------------------------------------------------------


def test_text_mode_writes_words_and_stops_on_its_own() -> None:
    prompts = text_prompts(200)
    requests = [Request(f"r{i}", prompt, 20_000) for i, prompt in enumerate(prompts)]
    outputs = generate(MockModel(), requests, 16, 256, include_stop=True)
    allowed = set((string.ascii_letters + " .").encode())
    vocabulary = {w.lower() for w in WORDS}
    lengths = []
    for tokens in outputs.values():
        assert tokens[-1] == 256  # ended by the stop token, not by max_tokens
        body = tokens[:-1]
        assert set(body) <= allowed
        text = bytes(body).decode("ascii")
        words = [w.strip(".").lower() for w in text.split()]
        assert all(w in vocabulary for w in words[1:])  # the first may finish the prompt's word
        lengths.append(len(tokens))
    mean = sum(lengths) / len(lengths)
    assert 30 <= mean <= 300  # tens to hundreds of tokens
    assert len(set(lengths)) > 20  # lengths vary


def test_text_mode_sentences_start_capitalised() -> None:
    requests = [Request(f"r{i}", prompt, 2_000) for i, prompt in enumerate(text_prompts(50))]
    for tokens in generate(MockModel(), requests, 8, 256).values():
        text = bytes(tokens).decode("ascii")
        for sentence in text.split(". ")[1:]:
            if sentence:
                assert sentence[0].isupper(), text


@pytest.mark.parametrize("stop_probability", [0.02, 0.05])
def test_text_mode_stop_probability_sets_the_mean_length(stop_probability: float) -> None:
    model = MockModel(MockLanguage(stop_probability=stop_probability))
    requests = [Request(f"r{i}", p, 50_000) for i, p in enumerate(text_prompts(150, seed=3))]
    lengths = [len(t) + 1 for t in generate(model, requests, 16, 256).values()]
    mean = sum(lengths) / len(lengths)
    assert 0.5 / stop_probability <= mean <= 2.0 / stop_probability


@pytest.mark.parametrize(("vocab_size", "stop_probability"), [(50, 0.01), (50, 0.1), (257, 0.05)])
def test_random_mode_stops_with_the_given_probability_per_token(
    vocab_size: int, stop_probability: float
) -> None:
    language = MockLanguage(
        text=False, vocab_size=vocab_size, stop_token=7, stop_probability=stop_probability
    )
    rng = random.Random(0)
    draws = 20_000
    tokens = [
        language.next_token([rng.randrange(vocab_size) for _ in range(rng.randint(1, 10))])
        for _ in range(draws)
    ]
    rate = tokens.count(7) / draws
    assert abs(rate - stop_probability) < 4 * (stop_probability / draws) ** 0.5 + 0.002
    assert all(0 <= t < vocab_size for t in tokens)
    assert len(set(tokens)) == vocab_size  # every id is reachable


def test_random_mode_without_stop_probability_never_stops() -> None:
    language = MockLanguage(text=False, vocab_size=10, stop_token=3, stop_probability=0.0)
    rng = random.Random(1)
    assert all(language.next_token([rng.randrange(10), i]) != 3 for i in range(5_000))


def test_stop_probability_one_stops_at_once() -> None:
    for text in (True, False):
        language = MockLanguage(text=text, stop_probability=1.0)
        out = generate(MockModel(language), [Request("a", list(b"hi there "), 100)], 1, 256)
        assert len(out["a"]) <= 8  # at most the first word before the stop


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stop_probability": -0.1},
        {"stop_probability": 1.5},
        {"vocab_size": 256},  # text mode needs the 256 byte ids plus a stop token
        {"vocab_size": 300, "stop_token": 300},
        {"text": False, "vocab_size": 10, "stop_token": -1},
    ],
)
def test_bad_language_parameters_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MockLanguage(**kwargs)  # type: ignore[arg-type]


def test_long_prefix_reads_a_bounded_part() -> None:
    """A token costs the same for a short and a very long prefix: only the head, the length and
    the tail are read, so changing the middle of a long prefix changes nothing."""
    language = MockLanguage()
    prefix = list(b"Once upon a time ") + [ord("x")] * 5000 + list(b" the ")
    changed = list(prefix)
    changed[2000] = ord("y")
    assert language.next_token(prefix) == language.next_token(changed)


# --- the KV-cache mock ------------------------------------------------------------------------


def prefill(slot: int, tokens: list[int], start: int = 0, sample: bool = True) -> PrefillChunk:
    return PrefillChunk(slot, tokens, start, sample, DEFAULT_SAMPLING, f"r{slot}")


def batch(
    decodes: Iterable[tuple[int, int]] = (), prefills: Iterable[PrefillChunk] = ()
) -> StepBatch:
    """A step feeding ``(slot, last token)`` decodes and ``prefills``."""
    decodes = list(decodes)
    slots = [slot for slot, _ in decodes]
    tokens = [token for _, token in decodes]
    ids = [f"r{slot}" for slot in slots]
    return StepBatch(slots, tokens, [DEFAULT_SAMPLING] * len(slots), ids, list(prefills))


def test_cached_mock_contract_errors() -> None:
    model = CachedMockModel(2)
    with pytest.raises(SlotReuseError, match="slot 1"):
        model.step(batch([(1, 5)]))  # never prefilled
    model.step(batch(prefills=[prefill(0, [1, 2])]))
    with pytest.raises(SlotReuseError, match="slot 0"):
        model.step(batch(prefills=[prefill(0, [3])]))  # a fresh chunk without a release
    with pytest.raises(SlotReuseError, match="starts at 3, cache holds 2"):
        model.step(batch(prefills=[prefill(0, [3], start=3)]))  # a gap
    with pytest.raises(SlotReuseError, match="starts at 1, cache holds 0"):
        model.step(batch(prefills=[prefill(1, [3], start=1)]))  # a continuation of nothing
    model.release(0)
    model.release(0)  # idempotent: a slot whose first chunk failed holds nothing to release
    with pytest.raises(SlotReuseError):
        model.step(batch([(0, 5)]))  # released: no longer decodable
    assert model.held_slots() == []


def test_cached_mock_matches_the_stateless_mock_token_by_token() -> None:
    prompts = text_prompts(3, seed=5)
    cached, stateless = CachedMockModel(3), MockModel()
    first = cached.step(batch(prefills=[prefill(slot, p) for slot, p in enumerate(prompts)]))
    prefixes = [list(p) for p in prompts]
    assert first == stateless.next_tokens(prefixes)
    last = first
    for _ in range(25):
        for prefix, token in zip(prefixes, last, strict=True):
            prefix.append(token)
        last = cached.step(batch(list(enumerate(last))))
        assert last == stateless.next_tokens(prefixes)


@FAST
@given(prompt=prefixes, cuts=st.lists(st.integers(1, 40), max_size=5))
def test_a_chunked_prefill_samples_what_a_whole_one_does(
    prompt: list[int], cuts: list[int]
) -> None:
    """Any split of a prompt into chunks leaves the same cache and samples the same token, and
    only the last chunk samples."""
    model = CachedMockModel(1)
    bounds = sorted({0, len(prompt), *(c for c in cuts if c < len(prompt))})
    outputs = []
    for start, end in itertools.pairwise(bounds):
        last = end == len(prompt)
        outputs.append(model.step(batch(prefills=[prefill(0, prompt[start:end], start, last)])))
    assert outputs[:-1] == [[]] * (len(outputs) - 1)
    assert outputs[-1] == MockModel().next_tokens([prompt])
    assert model.cached_tokens(0) == len(prompt)


def test_cached_mock_decodes_and_prefills_in_one_step() -> None:
    """Decode outputs come first, then one per sampling chunk, whatever the slot order."""
    model, stateless = CachedMockModel(3), MockModel()
    (t0,) = model.step(batch(prefills=[prefill(2, [4, 5, 6])]))
    out = model.step(
        batch([(2, t0)], [prefill(0, [1, 2], sample=False), prefill(1, [9], sample=True)])
    )
    assert out == stateless.next_tokens([[4, 5, 6, t0], [9]])
    assert model.held_slots() == [0, 1, 2]
    assert [model.cached_tokens(s) for s in range(3)] == [2, 1, 4]


def test_cached_mock_cache_is_empty_after_release() -> None:
    model = CachedMockModel(4)
    assert model.held_slots() == []
    model.step(batch(prefills=[prefill(1, [1]), prefill(3, [1, 2])]))
    assert model.held_slots() == [1, 3] and model.cached_tokens(3) == 2
    model.release(1)
    assert model.held_slots() == [3] and model.cached_tokens(1) == 0


# --- tokenizer --------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_stream_decoding() -> None:
    tokenizer = ByteTokenizer()
    text = "héllo wörld ✓"
    ids = tokenizer.encode(text)
    assert tokenizer.decode([*ids, tokenizer.eos_token_id]) == text
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.feed([i]) for i in ids]  # one byte at a time, splitting characters
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
