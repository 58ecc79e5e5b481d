"""A byte-level tokenizer: token ids 0-255 are UTF-8 bytes, 256 is the end-of-sequence token."""

from __future__ import annotations

import codecs

EOS_TOKEN_ID = 256
VOCAB_SIZE = 257


class ByteTokenizer:
    """Text <-> token ids. Ids outside 0-255 (EOS) decode to nothing."""

    eos_token_id = EOS_TOKEN_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder()


class StreamDecoder:
    """Decodes a token stream piece by piece; a UTF-8 character split across deltas is held back
    until it is complete, so streamed text concatenates to exactly the whole decoded text."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: list[int]) -> str:
        return self._decoder.decode(bytes(i for i in ids if 0 <= i < 256))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
