"""Tokenizers: the interface the server and the engine's output path use, and the mocks'
byte-level tokenizer (token ids 0-255 are UTF-8 bytes, 256 is the end-of-sequence token)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

EOS_TOKEN_ID = 256
VOCAB_SIZE = 257


class StreamDecoder(Protocol):
    """Turns one request's token stream into text piece by piece. ``feed`` returns only text
    that later tokens cannot change (a multi-byte character or a merge still open is held back),
    so the pieces concatenate to exactly ``decode`` of all tokens once ``flush`` has run."""

    def feed(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    """Text <-> token ids for one model. ``stop_token_ids`` end generation unless a request
    ignores EOS (the end-of-sequence token and any other stop ids of the checkpoint)."""

    @property
    def eos_token_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def stop_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes ``token`` stands for (part of a character when the tokenizer splits a
        multi-byte character across tokens); a special token's are its decoded text's."""
        ...

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The token ids of a chat (``(role, content)`` pairs) with the model's chat template
        applied and the assistant's turn opened."""
        ...


class ByteTokenizer:
    """Text <-> token ids. Ids outside 0-255 (EOS) decode to nothing."""

    eos_token_id = EOS_TOKEN_ID
    vocab_size = VOCAB_SIZE
    stop_token_ids = frozenset((EOS_TOKEN_ID,))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> ByteStreamDecoder:
        return ByteStreamDecoder()

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,)) if 0 <= token < 256 else b""

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The mock's chat template: one ``role: content`` line per message, then the cue."""
        lines = [f"{role}: {content}" for role, content in messages]
        return self.encode("\n".join([*lines, "assistant: "]))


class ByteStreamDecoder:
    """Decodes a token stream piece by piece; a UTF-8 character split across deltas is held back
    until it is complete, so streamed text concatenates to exactly the whole decoded text."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(bytes(i for i in ids if 0 <= i < 256))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
