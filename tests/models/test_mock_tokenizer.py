"""``--tokenizer PATH``: the mocks count and write text in a real vocabulary (issue 28), so a
client's token counts, the server's ``usage`` and the step clock agree. The tokenizer is a tiny
byte-level BPE trained here (tests/hf_tiny.py), never fetched."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ClientFactory
from hf_tiny import save_tokenizer

pytest.importorskip("transformers")

PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."


@pytest.mark.parametrize("model", ["mock", "cached-mock"])
async def test_prompts_and_outputs_are_counted_in_the_tokenizer(
    tmp_path: Path, make_client: ClientFactory, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = save_tokenizer(tmp_path)
    monkeypatch.setenv("SLOTSERVE_MODEL", model)  # (make_client's own ``model`` is a Model)
    async with make_client(tokenizer=str(tmp_path)) as client:
        body = {"model": "slotserve-mock", "prompt": PROMPT, "max_tokens": 30, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        data = response.json()
    assert data["usage"]["prompt_tokens"] == len(tok.encode(PROMPT))  # the client's count
    assert data["usage"]["completion_tokens"] == 30
    text = data["choices"][0]["text"]
    assert text.strip() and all(c.isalpha() or c in " ." for c in text)  # words, not bytes
    assert len(tok.encode(text, add_special_tokens=False)) == 30  # re-tokenizes to the count


def test_a_folder_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    from app.models.hf.errors import ModelLoadError
    from app.models.vocabulary import load_tokenizer

    with pytest.raises(ModelLoadError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_tokenizer(tmp_path / "missing")
