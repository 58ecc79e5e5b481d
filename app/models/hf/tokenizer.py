"""A checkpoint's Hugging Face tokenizer behind the server's ``Tokenizer`` protocol."""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme): the printable
    Latin-1 bytes stand for themselves, the others, in order, for U+0100 onwards."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(0x100 + i): b for i, b in enumerate(others)}


BYTE_OF_CHAR = _byte_alphabet()


class HFTokenizer:
    """Wraps a transformers tokenizer loaded from a local folder. ``encode`` adds the
    checkpoint's special tokens (a BOS where it uses one); ``decode`` skips special tokens."""

    def __init__(
        self, tokenizer: Any, *, vocab_size: int, stop_token_ids: frozenset[int], eos_token_id: int
    ) -> None:
        self._tok = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids | {eos_token_id}
        self.eos_token_id = eos_token_id

    def backend_json(self) -> str:
        """The ``tokenizers`` JSON of this tokenizer, without padding or truncation (the grammar
        engine builds its vocabulary from it)."""
        backend = copy.copy(self._tok.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return str(backend.to_str())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def pieces(self, text: str) -> list[int]:
        """``text``'s ids without special tokens (a fragment, not a sequence start)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def spell(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string as the vocabulary spells it (``"Ġcapital"``)."""
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(ids))]

    def token_strings(self) -> list[str]:
        """Every id's token string (the vocabulary's own spelling), by id, added tokens
        included."""
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(range(len(self._tok))))]

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._tok.all_special_ids) | self.stop_token_ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self._tok.decode(
                list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )

    def stream_decoder(self) -> HFStreamDecoder:
        return HFStreamDecoder(self)

    def token_bytes(self, token: int) -> bytes:
        """A byte-level BPE token's string mapped back through the byte alphabet; a
        SentencePiece byte-fallback token (``<0xNN>``) as its byte, another with ``▁`` as a
        space; a special token (or one not read so) as its decoded text."""
        piece = self._tok.convert_ids_to_tokens(token)
        if not isinstance(piece, str) or token in self._special:
            return self.decode([token]).encode()
        if self._byte_level:
            if all(c in BYTE_OF_CHAR for c in piece):
                return bytes(BYTE_OF_CHAR[c] for c in piece)
            return self.decode([token]).encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes((int(piece[3:5], 16),))
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _special(self) -> frozenset[int]:
        return frozenset(self._tok.all_special_ids)

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the backend decodes through the byte-level alphabet (GPT-2, SmolLM2)."""
        decoder = getattr(getattr(self._tok, "backend_tokenizer", None), "decoder", None)
        try:
            state: Any = decoder.__getstate__()
            return b'"ByteLevel"' in bytes(state)
        except (AttributeError, TypeError):
            return False

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The checkpoint's chat template with the assistant's turn opened; a checkpoint without
        one gets ``role: content`` lines and an ``assistant: `` cue."""
        chat = [{"role": role, "content": content} for role, content in messages]
        if getattr(self._tok, "chat_template", None):
            return self.chat_prompt_with_tools(chat, [])
        lines = [f"{role}: {content}" for role, content in messages]
        return self.encode("\n".join([*lines, "assistant: "]))

    @property
    def supports_tools(self) -> bool:
        """Whether the checkpoint's chat template renders tools (it reads a ``tools`` variable)."""
        template = getattr(self._tok, "chat_template", None)
        return isinstance(template, str) and "tools" in template

    def chat_prompt_with_tools(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> list[int]:
        """The chat template applied to OpenAI-shaped messages (``tool_calls`` with arguments as
        objects, ``tool`` messages) and ``tools``, with the assistant's turn opened."""
        text = self._tok.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        return self.pieces(str(text))


class HFStreamDecoder:
    """Incremental detokenization with a prefix and a read offset (as vLLM's detokenizer does):
    each ``feed`` decodes a short window of recent tokens with and without the new ones and
    returns the difference, holding it back while it ends in an incomplete character
    (U+FFFD), so streamed pieces never cut a multi-byte character and concatenate to ``decode``
    of all tokens once ``flush`` has run."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # end of the tokens already returned as text

    def feed(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        delta = self._delta()
        if not delta or delta.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def flush(self) -> str:
        delta = self._delta()
        self._prefix = self._read = len(self._ids)
        return delta

    def _delta(self) -> str:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read])
        after = decode(self._ids[self._prefix :])
        return after[len(before) :]
