"""The grammar engine's view of a tokenizer: every token's bytes and the end-of-sequence ids.

The mocks' ``ByteTokenizer`` (ids 0-255 are bytes, 256 is EOS) becomes a 257-token vocabulary;
a checkpoint's tokenizer hands over its ``tokenizers`` JSON (``backend_json()``). Building the
vocabulary costs ~1 s for a 49k BPE vocabulary: do it once per model, off the event loop.
"""

from __future__ import annotations

from typing import Any

import llguidance

from app.models.tokenizer import ByteTokenizer, Tokenizer


class _ByteVocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, EOS, an encoder."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
        self.special_token_ids = [tokenizer.eos_token_id]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def grammar_vocabulary(tokenizer: Tokenizer) -> Any:
    """An ``llguidance.LLTokenizer`` for ``tokenizer`` whose EOS tokens are its stop ids."""
    eos = sorted(tokenizer.stop_token_ids | {tokenizer.eos_token_id})
    if isinstance(tokenizer, ByteTokenizer):
        wrapper = llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer))
        return llguidance.LLTokenizer(wrapper, n_vocab=tokenizer.vocab_size, eos_token=eos)
    backend = getattr(tokenizer, "backend_json", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} offers no vocabulary for grammars")
    return llguidance.LLTokenizer(backend(), n_vocab=tokenizer.vocab_size, eos_token=eos)
