"""The compiled forward (``--compile auto``, app/models/hf/compiled.py) against the eager one on
a tiny random Llama in float32: the same greedy tokens through slots, chunked prefill and
preemption, logits within 1e-4 (float32 rounding: inductor fuses and reorders the RMSNorm and
RoPE arithmetic), the seeded-request guarantee, no compile after the start's warm-up, the
compiled code cached under the model's cache folder and loaded by a second start, and the
eager path where no compiler is or compiling fails."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from hf_tiny import Driver, DriverRequest, random_prompts, save_tiny_model, save_tokenizer

from app.models.hf import LoadedModel, load_model
from app.models.hf.compiled import CompiledForward, resolve, use_cache_folder
from app.models.protocol import GREEDY, PrefillChunk, SamplingParams, StepBatch

pytestmark = pytest.mark.real_model
VOCAB = 320
LOGIT_TOLERANCE = 1e-4  # absolute, float32 logits of standard deviation ~1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    save_tokenizer(folder)
    return save_tiny_model(folder)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def load(checkpoint: Path, cache_dir: Path, compile: str, num_slots: int = 4) -> LoadedModel:
    return load_model(
        f"hf:{checkpoint}",
        dtype="float32",
        num_slots=num_slots,
        max_model_len=256,
        kv_cache_memory=64 << 20,
        cache_dir=cache_dir,
        compile=compile,
    )


@pytest.fixture(scope="module")
def compiled(checkpoint: Path, cache_dir: Path) -> LoadedModel:
    loaded = load(checkpoint, cache_dir, "auto")
    assert isinstance(loaded.model._forward, CompiledForward)
    return loaded


def mixed_batch(prompts: list[list[int]], last: list[int]) -> StepBatch:
    """Slots 0 and 2 decode their next token; slot 1 prefills a chunk mid-prompt; slot 3 a
    whole prompt."""
    return StepBatch(
        decode_slots=[2, 0],
        decode_tokens=[last[2], last[0]],
        decode_sampling=[GREEDY, GREEDY],
        decode_request_ids=["c", "a"],
        prefills=[
            PrefillChunk(1, prompts[1][5:], 5, True, GREEDY, "b"),
            PrefillChunk(3, prompts[3], 0, True, GREEDY, "d"),
        ],
    )


def test_compiled_logits_match_eager_within_tolerance(
    checkpoint: Path, cache_dir: Path, compiled: LoadedModel
) -> None:
    eager = load(checkpoint, cache_dir, "off").model
    model = compiled.model
    prompts = [p + [7] * 8 for p in random_prompts(4, VOCAB, seed=3)]
    logits = []
    for m in (eager, model):
        for slot in range(4):
            m.release(slot)
        first = StepBatch(
            [], [], [], [],
            [PrefillChunk(s, prompts[s][: 5 if s == 1 else None], 0, s != 1, GREEDY, str(s))
             for s in range(3)],
        )  # fmt: skip
        opening = m.step_logits(first)
        last = [int(t) for t in opening.argmax(dim=1)]
        logits.append((opening, m.step_logits(mixed_batch(prompts, [last[0], 0, last[1]]))))
    for eager_rows, compiled_rows in zip(*logits, strict=True):
        assert eager_rows.shape == compiled_rows.shape
        torch.testing.assert_close(
            compiled_rows, eager_rows, atol=LOGIT_TOLERANCE, rtol=0
        )  # fmt: skip


def test_compiled_greedy_tokens_equal_eager_through_chunks_and_preemption(
    checkpoint: Path, cache_dir: Path, compiled: LoadedModel
) -> None:
    def run(loaded: LoadedModel) -> dict[str, list[int]]:
        for slot in range(4):
            loaded.model.release(slot)
        prompts = random_prompts(7, VOCAB, seed=8)
        requests = [DriverRequest(f"r{i}", p, max_new=12) for i, p in enumerate(prompts)]
        driver = Driver(loaded.model, 4, chunk=6, preempt_at={4: None, 11: None})
        return driver.run(requests, arrivals=[0, 0, 1, 3, 5, 6, 9])

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert run(compiled) == run(load(checkpoint, cache_dir, "off"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # warm-up did all


def test_seeded_request_gets_the_same_tokens_whatever_the_batch_compiled(
    compiled: LoadedModel,
) -> None:
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    model = compiled.model

    def sampled(others: int, preempt_at: dict[int, str | None]) -> list[int]:
        for slot in range(4):
            model.release(slot)
        prompts = random_prompts(others + 1, VOCAB, seed=11)
        requests = [
            DriverRequest(f"o{i}", p, max_new=16, sampling=SamplingParams(temperature=1.0))
            for i, p in enumerate(prompts[1:])
        ]
        requests.insert(others // 2, DriverRequest("seeded", prompts[0], 16, seeded))
        return Driver(model, 4, chunk=5, preempt_at=preempt_at).run(requests)["seeded"]

    alone = sampled(0, {})
    assert sampled(6, {}) == alone
    assert sampled(5, {4: "seeded"}) == alone
    assert len(set(alone)) > 3


def test_compiled_code_is_cached_under_the_model_cache_folder_and_a_second_start_loads_it(
    compiled: LoadedModel, checkpoint: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = cache_dir / "inductor-cache"
    assert folder.is_dir() and any(folder.rglob("*.py"))
    with caplog.at_level(logging.INFO, logger="slotserve.model"):
        again = load(checkpoint, cache_dir, "auto")
    assert caplog.text.count("loaded the decoder layer") == 2, caplog.text
    assert "compiled the decoder layer" not in caplog.text
    prefill = StepBatch([], [], [], [], [PrefillChunk(0, [5, 6, 7], 0, True, GREEDY, "x")])
    for model in (compiled.model, again.model):
        model.release(0)
    assert again.model.step_logits(prefill).equal(compiled.model.step_logits(prefill))


def test_auto_runs_eager_without_a_compiler(
    checkpoint: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve("off", "cpu") == (False, "--compile off")
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    compiling, why = resolve("auto", "cpu")
    assert not compiling and "no C++ compiler" in why
    loaded = load(checkpoint, cache_dir, "auto")
    assert not isinstance(loaded.model._forward, CompiledForward)
    assert loaded.model.step(
        StepBatch([], [], [], [], [PrefillChunk(0, [5, 6], 0, True, GREEDY, "x")])
    )


def test_auto_runs_eager_when_the_compiler_inductor_calls_is_missing() -> None:
    from torch._inductor import config

    # CXX=/nonexistent with g++ still on the PATH: inductor calls $CXX only
    with config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        compiling, why = resolve("auto", "cpu")
    assert not compiling and "no C++ compiler" in why


def test_a_cache_folder_it_cannot_write_only_costs_the_saving(
    compiled: LoadedModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Unwritable:
        def save_compiled_function(self, path: str) -> None:
            raise OSError(30, "Read-only file system", path)

    forward = compiled.model._forward
    assert isinstance(forward, CompiledForward)
    forward._save(Unwritable(), tmp_path / "layer.bin")  # logs, does not raise
    assert "not saved" in caplog.text
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr("os.access", lambda path, mode: False)
    use_cache_folder(tmp_path)  # inductor keeps its default: it locks files in its folder
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_a_failed_compile_leaves_the_eager_forward(
    checkpoint: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(forward: CompiledForward) -> float:
        raise RuntimeError("the C++ compiler crashed")

    monkeypatch.setattr("app.models.hf.compiled.warm_up", broken)
    loaded = load(checkpoint, cache_dir, "auto")
    assert not isinstance(loaded.model._forward, CompiledForward)
    assert loaded.model.step(
        StepBatch([], [], [], [], [PrefillChunk(0, [5, 6], 0, True, GREEDY, "x")])
    )
