"""The real model's logits processors and log probabilities: against plain references and
transformers, on a tiny random checkpoint (float64)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hf_tiny import save_tiny_model, save_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from app.api.app import create_app
from app.config import Settings
from app.models.hf import load_model
from app.models.hf.logits_processors import process
from app.models.protocol import NO_TOKEN, PrefillChunk, SamplingParams, StepBatch

VOCAB = 12


@dataclass
class History:
    tokens: list[int]
    prompt_len: int
    stop_token_ids: frozenset[int] = frozenset({0})


token = st.integers(0, VOCAB - 1)
histories = st.builds(
    lambda prompt, out: History(prompt + out, len(prompt)),
    st.lists(token, min_size=1, max_size=6),
    st.lists(token, max_size=6),
)
params = st.builds(
    SamplingParams,
    frequency_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    presence_penalty=st.sampled_from([0.0, 1.5]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.7]),
    logit_bias=st.lists(st.tuples(token, st.sampled_from([-100.0, 3.0])), max_size=3).map(tuple),
    min_tokens=st.integers(0, 4),
    bad_words=st.lists(st.lists(token, min_size=1, max_size=2).map(tuple), max_size=2).map(tuple),
    allowed_token_ids=st.none()
    | st.lists(token, min_size=1, max_size=4).map(lambda ids: tuple(sorted(set(ids)))),
)


def reference(row: list[float], p: SamplingParams, h: History) -> list[float]:
    """One row, processed in plain Python (the definitions in logits_processors' docstring)."""
    out, prompt_len = list(row), h.prompt_len
    output = h.tokens[prompt_len:]
    for t in set(h.tokens):
        if p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    for t, bias in p.logit_bias:
        out[t] += bias
    bans = set(h.stop_token_ids) if len(output) < p.min_tokens else set()
    for word in p.bad_words:
        head = list(word[:-1])
        if not head or (len(output) >= len(head) and output[len(output) - len(head) :] == head):
            bans.add(word[-1])
    for t in bans:
        out[t] = -math.inf
    if p.allowed_token_ids is not None:
        out = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(out)]
    return out


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.tuples(st.booleans(), params, histories), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_processors_change_only_their_rows_and_match_the_reference(
    rows: list[tuple[bool, SamplingParams, History]], seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB, generator=generator, dtype=torch.float64)
    before = logits.clone()
    chosen = [p if on else SamplingParams() for on, p, _ in rows]
    process(logits, chosen, [h for _, _, h in rows])
    for i, (p, (_, _, h)) in enumerate(zip(chosen, rows, strict=True)):
        want = reference(before[i].tolist(), p, h)
        assert logits[i].tolist() == pytest.approx(want), i


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-sampling")
    save_tokenizer(folder)
    return save_tiny_model(folder)


@asynccontextmanager
async def real_client(checkpoint: Path, **flags: Any) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(model=f"hf:{checkpoint}", dtype="float64", num_slots=4,
                        kv_cache_memory=1 << 20, max_model_len=128, **flags)  # fmt: skip
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await app.state.serving.wait_loaded()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


def hf_log_softmax(checkpoint: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0], dim=-1)


async def test_echo_logprobs_equal_transformers_and_greedy_logprobs_are_the_top(
    tiny: Path,
) -> None:
    prompt = [5, 17, 42, 99, 7, 250, 31, 64, 12, 200, 11]
    async with real_client(tiny, max_num_batched_tokens=4) as client:  # chunked prefill
        body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
        scored = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        body = {"prompt": prompt, "max_tokens": 3, "logprobs": 2, "temperature": 0}
        r = await client.post("/v1/completions", json=body | {"prompt_logprobs": 1})
        generated = r.json()["choices"][0]
    want = hf_log_softmax(tiny, prompt)
    values = scored["logprobs"]["token_logprobs"]
    assert values[0] is None and len(values) == len(prompt)
    for position in range(1, len(prompt)):
        assert values[position] == pytest.approx(float(want[position - 1, prompt[position]]))
    for position, entry in enumerate(generated["prompt_logprobs"][1:], 1):
        want_value = float(want[position - 1, prompt[position]])
        assert entry[str(prompt[position])]["logprob"] == pytest.approx(want_value)
        # vLLM's rank: 1 + the tokens the model found more likely there
        want_rank = int((want[position - 1] > want[position - 1, prompt[position]]).sum()) + 1
        assert entry[str(prompt[position])]["rank"] == want_rank
    lp = generated["logprobs"]
    first = int(want[-1].argmax())
    assert lp["token_logprobs"][0] == pytest.approx(float(want[-1, first]))
    for value, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert max(top.values()) == pytest.approx(value)  # greedy: the chosen is the top


async def test_bans_allow_lists_and_min_tokens_reach_the_real_model(tiny: Path) -> None:
    prompt = [5, 17, 42, 99]
    async with real_client(tiny) as client:
        base = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        plain = (await client.post("/generate", json=base | {"stream": False})).json()["tokens"]
        banned = {str(t): -100 for t in set(plain)}
        r = await client.post("/generate", json=base | {"stream": False, "logit_bias": banned})
        assert not set(r.json()["tokens"]) & set(plain)
        r = await client.post(
            "/generate", json=base | {"stream": False, "allowed_token_ids": [3, 8, 9]}
        )
        assert set(r.json()["tokens"]) <= {3, 8, 9}
        # eos (2) and the generation config's 4 as stop ids: allowed only after min_tokens
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop_token_ids": [2, 4],
                "stream": False, "min_tokens": 8, "allowed_token_ids": [2, 4, 9]}  # fmt: skip
        r = await client.post("/generate", json=body)
        assert r.json()["tokens"] == [9] * 8
        penalized = await client.post(
            "/generate",
            json=base | {"stream": False, "repetition_penalty": 2.0, "frequency_penalty": 2.0},
        )
        assert penalized.status_code == 200 and len(penalized.json()["tokens"]) == 6


async def test_n_choices_draw_with_seed_plus_i(tiny: Path) -> None:
    """Choice i of a seeded request is the request with seed + i, whatever shares its batch."""
    prompt = [5, 17, 42, 99]
    async with real_client(tiny) as client:
        base = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        both = (await client.post("/v1/completions", json=base | {"n": 2, "seed": 3})).json()
        alone = [
            (await client.post("/v1/completions", json=base | {"seed": seed})).json()
            for seed in (3, 4)
        ]
    assert [c["text"] for c in both["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert both["usage"]["completion_tokens"] == 12


def test_a_row_whose_every_token_is_banned_gets_no_token_not_nan(tiny: Path) -> None:
    """The API refuses what it can see; a ban known only mid-output can still empty a row:
    that row alone gets NO_TOKEN, its neighbours sample as usual, no NaN anywhere."""
    loaded = load_model(f"hf:{tiny}", dtype="float32", num_slots=2, max_model_len=32,
                        kv_cache_memory=1 << 20)  # fmt: skip
    dead = SamplingParams(allowed_token_ids=(9,), bad_words=((9,),), logprobs=2)
    alive = SamplingParams(temperature=1.0, seed=1, logprobs=2)
    chunks = [
        PrefillChunk(slot, [5, 17, 42], 0, True, params, f"r{slot}")
        for slot, params in enumerate((dead, alive))
    ]
    result = loaded.model.step_sampled(StepBatch((), (), (), (), chunks))
    assert result.tokens[0] == NO_TOKEN and 0 <= result.tokens[1] < 320
    assert result.logprobs is not None and result.logprobs[0] is None
    entry = result.logprobs[1]
    assert entry is not None and math.isfinite(entry.logprob)


@pytest.mark.parametrize("penalty", [1e-308, 1e-40, 1e308])
def test_an_extreme_repetition_penalty_leaves_every_logit_finite(penalty: float) -> None:
    """Review: repetition_penalty 1e-308 (0 in float32) made a seen token's positive logit inf
    (1e308, inf there, made a 0 logit NaN), the draw's probabilities NaN and the model call
    fail: SmolLM2 answered 500 to that request and to a concurrent one in the same step. Any
    finite penalty above 0 (vLLM's range) now leaves every logit finite."""
    logits = torch.tensor([[5.0, -3.0, 0.0, 1.0, 2.0], [5.0, -3.0, 0.0, 1.0, 2.0]])
    params = [SamplingParams(repetition_penalty=penalty), SamplingParams()]
    process(logits, params, [History([0, 1, 2, 3], 4), None])
    assert bool(torch.isfinite(logits).all()), logits
    assert logits[1].tolist() == [5.0, -3.0, 0.0, 1.0, 2.0]  # its neighbour untouched
    # a penalty below 1 favours the seen tokens (5.0 first), one above 1 the unseen (2.0)
    assert int(logits[0].argmax()) == (0 if penalty < 1 else 4)
