"""``--tokenizer PATH``: the mocks count and write text in a real model's vocabulary.

The tokenizer (a Hugging Face tokenizer folder, read locally) counts prompts (so ``usage``,
the prefix cache and the step clock agree with a client that tokenizes with it), and the mock
writes words that are single tokens of it: " the", " model", ... (``MockLanguage.words``), so
the text a client re-tokenizes has as many tokens as the server generated.
"""

from __future__ import annotations

from pathlib import Path

from app.models.hf.tokenizer import HFTokenizer

MIN_WORDS = 8  # fewer single-token words: draw from every ordinary token instead


def load_tokenizer(folder: str | Path) -> HFTokenizer:
    """The tokenizer of ``folder`` (``ModelLoadError`` naming the folder if it has none)."""
    from app.models.hf.errors import ModelLoadError
    from app.models.hf.loader import _generation_config, _tokenizer

    path = Path(folder)
    if not path.is_dir():
        raise ModelLoadError(f"--tokenizer {folder}: not a folder")
    return _tokenizer(path, None, _generation_config(path))


def word_ids(tokenizer: HFTokenizer, limit: int = 4096) -> tuple[int, ...]:
    """Up to ``limit`` ids of whole words with their leading space (byte-level BPE's "Ġword",
    SentencePiece's "▁word") that the tokenizer writes back as that one token, so any run of
    them re-tokenizes to as many tokens; every non-special id if there are too few."""
    special = tokenizer.special_ids
    ids: list[int] = []
    for token_id, piece in enumerate(tokenizer.token_strings()):
        if len(ids) >= limit:
            break
        word = piece[1:] if piece[:1] in ("\u0120", "\u2581") else ""
        ordinary = len(word) >= 2 and word.isascii() and word.isalpha()
        if ordinary and token_id not in special and tokenizer.pieces(" " + word) == [token_id]:
            ids.append(token_id)
    if len(ids) >= MIN_WORDS:
        return tuple(ids)
    return tuple(i for i in range(tokenizer.vocab_size) if i not in special)
