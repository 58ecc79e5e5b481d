"""Our forward pass and KV cache against transformers, on tiny random checkpoints (float64 so
near-tied logits cannot flip a greedy choice): every request's greedy tokens equal
``model.generate`` on its prompt alone, whatever the slots, arrivals, chunking, preemptions and
cancels around it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_tiny import Driver, DriverRequest, random_prompts, save_tiny_model, save_tokenizer

from app.models.hf import LoadedModel, load_model
from app.models.hf.runner import SlotStateError
from app.models.protocol import GREEDY, PrefillChunk, SamplingParams, StepBatch

VOCAB = 320


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    save_tokenizer(folder)
    return save_tiny_model(folder, family=request.param)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    model.eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model


def expected(reference: Any, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0
        )
    return [int(t) for t in out[0, len(prompt) :]]


def load(checkpoint: Path, num_slots: int, dtype: str = "float64") -> LoadedModel:
    return load_model(
        f"hf:{checkpoint}",
        dtype=dtype,
        num_slots=num_slots,
        max_model_len=256,
        kv_cache_memory=64 << 20,
    )


@pytest.mark.parametrize(
    ("num_slots", "chunk", "preempt_at", "cancel_at"),
    [
        (1, 1 << 30, {}, {}),
        (3, 7, {5: None, 12: None, 30: None}, {16: None}),
        (8, 16, {3: None, 9: None, 20: None}, {6: None}),
    ],
)
def test_greedy_tokens_equal_generate_on_each_prompt_alone(
    checkpoint: Path,
    reference: Any,
    num_slots: int,
    chunk: int,
    preempt_at: dict[int, str | None],
    cancel_at: dict[int, str | None],
) -> None:
    model = load(checkpoint, num_slots).model
    prompts = random_prompts(10, VOCAB)
    requests = [DriverRequest(f"r{i}", p, max_new=6 + 3 * i) for i, p in enumerate(prompts)]
    driver = Driver(model, num_slots, chunk=chunk, preempt_at=preempt_at, cancel_at=cancel_at)
    got = driver.run(requests, arrivals=[2 * i for i in range(len(requests))])
    assert (len(driver.preempted), len(driver.cancelled)) == (len(preempt_at), len(cancel_at))
    for request, prompt in zip(requests, prompts, strict=True):
        want = expected(reference, prompt, request.max_new)
        if request.rid in driver.cancelled:  # ended early: what it got is a prefix
            want = want[: len(got[request.rid])]
        assert got[request.rid] == want, request.rid


def test_one_step_logits_match_transformers_in_float32(checkpoint: Path) -> None:
    """One step mixing a decode token, a prefill chunk resuming at position 5 and a fresh
    prompt: each output row's logits equal transformers' on that sequence alone, within 1e-5
    relative to the logits' scale (float32 rounding; a wrong position, mask or cache entry is
    off by whole units)."""
    from transformers import AutoModelForCausalLM

    model = load(checkpoint, 4, dtype="float32").model
    a, b, c = random_prompts(3, VOCAB, seed=7)
    first = StepBatch([], [], [], [], [chunk(0, a, 0), chunk(2, b[:5], 0, sample=False)])
    model.step(first)
    step = StepBatch([0], [9], [GREEDY], ["a"], [chunk(2, b[5:], 5), chunk(3, c, 0)])
    logits = model.step_logits(step).double()
    sequences = ([*a, 9], b, c)
    hf: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([seq])).logits[0, -1] for seq in sequences]).double()
    assert logits.shape == want.shape
    difference = (logits - want).abs().max()
    assert difference <= 1e-5 * max(1.0, float(want.abs().max())), difference


def chunk(slot: int, tokens: list[int], start: int, *, sample: bool = True) -> PrefillChunk:
    return PrefillChunk(slot, tokens, start, sample, GREEDY, f"s{slot}")


def test_release_resets_a_slot_and_a_misplaced_chunk_is_refused(checkpoint: Path) -> None:
    model = load(checkpoint, 2).model
    prompt, other = random_prompts(2, VOCAB, seed=3)
    fresh = model.step(StepBatch([], [], [], [], [chunk(0, prompt, 0)]))
    model.step(StepBatch([], [], [], [], [chunk(1, other, 0)]))
    assert model.cache.lengths == [len(prompt), len(other)]
    with pytest.raises(SlotStateError, match="starts at 0"):
        model.step(StepBatch([], [], [], [], [chunk(1, prompt, 0)]))
    model.release(1)
    assert model.cache.lengths[1] == 0
    assert model.step(StepBatch([], [], [], [], [chunk(1, prompt, 0)])) == fresh


def test_a_slot_never_outgrows_its_context(checkpoint: Path) -> None:
    model = load(checkpoint, 1).model
    with pytest.raises(SlotStateError, match="exceed the context of 256"):
        model.step(StepBatch([], [], [], [], [chunk(0, [7] * 257, 0)]))


SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)


def test_seeded_sampling_gives_the_same_tokens_whatever_the_batch(checkpoint: Path) -> None:
    def sampled(num_slots: int, others: int, preempt_at: dict[int, str | None]) -> list[int]:
        model = load(checkpoint, num_slots).model
        prompts = random_prompts(others + 1, VOCAB, seed=11)
        requests = [
            DriverRequest(f"o{i}", p, max_new=20, sampling=SamplingParams(temperature=1.0))
            for i, p in enumerate(prompts[1:])
        ]
        requests.insert(others // 2, DriverRequest("seeded", prompts[0], 20, SEEDED))
        driver = Driver(model, num_slots, chunk=5, preempt_at=preempt_at)
        tokens = driver.run(requests)["seeded"]
        assert driver.preempted == list(preempt_at.values())
        return tokens

    alone = sampled(1, 0, {})
    assert sampled(8, 7, {}) == alone
    assert sampled(4, 6, {4: "seeded"}) == alone  # preempted and re-prefilled mid-way
    assert len(set(alone)) > 3  # really sampled, not a constant


def test_unseeded_sampling_varies_and_greedy_does_not(checkpoint: Path) -> None:
    model = load(checkpoint, 2).model
    prompt = random_prompts(1, VOCAB, seed=5)[0]
    runs = []
    for i in range(3):
        free = DriverRequest(f"f{i}", prompt, 12, SamplingParams(temperature=1.5))
        runs.append(tuple(Driver(model, 2).run([free])[f"f{i}"]))
    assert len(set(runs)) > 1
