"""The mock's "language": a deterministic, seeded function from a token prefix to the next token.

Both mock models use it, so their outputs are identical. It reads a bounded part of the prefix
(its head, its length and its last few tokens), so one token costs the same for a 16-token and an
8,000-token prefix, and a request's tokens are the same alone or in a full batch.

In text mode (the default) it writes readable English words byte by byte and ends with the stop
token after a sentence: it stops only at word ends, on average after about
``1.1 / stop_probability`` tokens (measured: mean 108, median 75 at 0.01). In random mode it
draws token ids uniformly from the vocabulary (never the stop token) and stops with
``stop_probability`` per token. With ``words`` (token ids of whole words of a real
vocabulary, see ``app.models.vocabulary``) it draws from them instead, so its text re-tokenizes
to the same count.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

SPACE = ord(" ")
PERIOD = ord(".")
HEAD = 8  # prefix tokens that identify a request's prompt
MAX_WORD = 16  # longest run of non-space tokens read back to find the current word
MEAN_WORD_TOKENS = 6.0  # average word length plus its space, for the per-boundary stop chance
SENTENCE_END = 0.12  # chance that a word ends its sentence
_SCALE = float(1 << 61)
_STOP_SALT = 0x5707  # keeps the stop draw independent of the word draw

_WORD_LIST = """the a an of to in for with on at by from as and or but so because while when then
    model models token tokens batch batches slot slots request requests queue server servers step
    steps cache caches prompt prompts stream streams client clients engine engines latency time
    first next last every each one two many few more most some all new old fast slow small large
    long short good best real simple quiet bright early late full empty free busy ready open
    serves waits runs reads writes sends keeps frees fills grows ends starts moves answers learns
    decodes admits streams batches schedules measures counts holds returns finishes arrives
    river mountain morning evening light water garden window city road story book letter music
    people teacher engineer student friend team house market village forest ocean island field
    quickly slowly gently always often never soon together again still only also very just
    """
WORDS = tuple(_WORD_LIST.split())


def _mix(*parts: object) -> int:
    """A well-spread 61-bit hash of small ints and tuples of ints (stable across processes)."""
    return hash(parts) & ((1 << 61) - 1)


@dataclass(frozen=True, slots=True)
class MockLanguage:
    """Parameters of the mock language. ``vocab_size`` must exceed 256 in text mode."""

    vocab_size: int = 257
    stop_token: int = 256
    seed: int = 0
    stop_probability: float = 1 / 100
    text: bool = True
    words: tuple[int, ...] = ()  # random mode: draw from these ids (empty: the whole vocabulary)

    def __post_init__(self) -> None:
        if not 0.0 <= self.stop_probability <= 1.0:
            raise ValueError("stop_probability must be within [0, 1]")
        if self.text and self.vocab_size <= 256:
            raise ValueError("text mode needs vocab_size > 256 (ids 0-255 are bytes)")
        if not 0 <= self.stop_token < self.vocab_size:
            raise ValueError("stop_token must be a token id within the vocabulary")

    def next_token(self, prefix: Seq[int]) -> int:
        if self.text:
            return self._next_text_token(prefix)
        n = len(prefix)
        key = _mix(self.seed, n, tuple(prefix[:HEAD]), tuple(prefix[-4:]))
        if (key & 0xFFFFFFFF) / 0x100000000 < self.stop_probability or self.vocab_size == 1:
            return self.stop_token
        if self.words:
            return self.words[(key >> 32) % len(self.words)]
        token = (key >> 32) % (self.vocab_size - 1)  # any id but the stop token
        return token + (token >= self.stop_token)

    def _next_text_token(self, prefix: Seq[int]) -> int:
        n = len(prefix)
        k = 0  # length of the word being written: the tokens since the last space
        while k < n and prefix[n - 1 - k] != SPACE:
            k += 1
            if k > MAX_WORD:
                return SPACE  # a long run of non-text tokens: start a fresh word
        start = n - k
        word = self._word_at(prefix, start)
        if k < len(word):
            if any(prefix[start + i] != word[i] for i in range(k)):
                return SPACE  # the prompt ended inside a word of its own: finish it
            return word[k]
        if self._stops_after(prefix, start):
            return self.stop_token
        return SPACE

    def _word_at(self, prefix: Seq[int], start: int) -> bytes:
        """The word that begins at position ``start``, capitalised after a sentence's end."""
        head = tuple(prefix[: min(HEAD, start)])  # fixed while the word is written
        before = tuple(prefix[max(0, start - 3) : start])
        key = _mix(self.seed, start, head, before)
        word = WORDS[key % len(WORDS)]
        if start < 2 or prefix[start - 2] == PERIOD:
            word = word.capitalize()
        ends_sentence = ((key >> 20) & 0xFFFF) / 0x10000 < SENTENCE_END
        if ends_sentence or self._stops_after(prefix, start):
            word += "."
        return word.encode()

    def _stops_after(self, prefix: Seq[int], start: int) -> bool:
        """Whether the word starting at ``start`` is the last one."""
        per_word = 1.0 - (1.0 - self.stop_probability) ** MEAN_WORD_TOKENS
        before = tuple(prefix[max(0, start - 3) : start])
        key = _mix(self.seed, start, tuple(prefix[: min(HEAD, start)]), before, _STOP_SALT)
        return bool(key / _SCALE < per_word)
