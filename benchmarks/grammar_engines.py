"""Grammar engines on this machine: llguidance vs xgrammar (issue 20, structured outputs).

For one JSON schema it measures, per engine and per vocabulary (SmolLM2's 49k BPE vocabulary
and the mocks' 257-token byte vocabulary): the one-off tokenizer preparation, the grammar
compile time (cold: first compile of a schema; each engine's own cache is bypassed by a fresh
schema title), and the per-token mask time while walking a valid JSON instance token by token.

xgrammar depends on torch, transformers and triton, so it is not a project dependency; run this
script with a venv that has it (see docs/benchmarks.md for the exact command). Figures only,
nothing asserted.

    python benchmarks/grammar_engines.py [--engines llguidance,xgrammar] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any, ClassVar

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["person", "robot", "other"]},
    },
    "required": ["name", "age", "email", "tags", "address", "kind"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace, the first programmer of a machine that did not exist yet",
    "age": 36,
    "email": "ada@math.com",
    "tags": ["math", "poetry", "engines"],
    "address": {"city": "London", "zip": "W1"},
    "kind": "person",
}
TEXT = json.dumps(INSTANCE, separators=(",", ":"))


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:8.1f} us"


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def schema_variant(i: int) -> str:
    return json.dumps({**SCHEMA, "title": f"bench{i}"})


class ByteVocab:
    """The mocks' vocabulary: ids 0-255 are bytes, 256 is EOS."""

    eos_token_id = 256
    bos_token_id = None
    tokens: ClassVar[list[bytes]] = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids: ClassVar[list[int]] = [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from app.models.hf.weights import default_cache_dir, smollm2_folder

    return AutoTokenizer.from_pretrained(smollm2_folder(default_cache_dir()))


def bench_llguidance(vocab: str, hf: Any, rounds: int) -> None:
    import llguidance as llg

    def build() -> Any:
        if vocab == "bytes":
            wrapper = llg.TokenizerWrapper(ByteVocab())
            return llg.LLTokenizer(wrapper, n_vocab=257, eos_token=256)
        backend = hf.backend_tokenizer
        return llg.LLTokenizer(backend.to_str(), n_vocab=len(hf), eos_token=hf.eos_token_id)

    prep, tok = timed(build)
    ids = list(TEXT.encode()) if vocab == "bytes" else hf.encode(TEXT)
    compiles, masks = [], []
    for r in range(rounds):
        grammar = llg.LLMatcher.grammar_from_json_schema(
            schema_variant(r), defaults={"whitespace_flexible": False}
        )
        start = time.perf_counter()
        matcher = llg.LLMatcher(tok, grammar, log_level=0)
        took = time.perf_counter() - start
        assert not matcher.is_error(), matcher.get_error()
        compiles.append(took)
        for t in ids:
            took, mask = timed(matcher.compute_bitmask)
            masks.append(took)
            assert mask[t >> 3] >> (t & 7) & 1, f"token {t} forbidden"
            assert matcher.consume_token(t)
    report("llguidance", vocab, prep, compiles, masks)


def bench_xgrammar(vocab: str, hf: Any, rounds: int) -> None:
    import xgrammar as xgr  # type: ignore[import-not-found]

    def build() -> Any:
        if vocab == "bytes":
            return xgr.TokenizerInfo(
                ByteVocab.tokens, vocab_type=xgr.VocabType.RAW, vocab_size=257, stop_token_ids=[256]
            )
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))

    prep, info = timed(build)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    ids = list(TEXT.encode()) if vocab == "bytes" else hf.encode(TEXT)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    compiles, masks = [], []
    for r in range(rounds):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(
            schema_variant(r), any_whitespace=False, separators=(",", ":")
        )
        took = time.perf_counter() - start
        compiles.append(took)
        matcher = xgr.GrammarMatcher(compiled)
        for t in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            took = time.perf_counter() - start
            masks.append(took)
            word = int(bitmask[0, t // 32])
            assert (word >> (t % 32)) & 1, f"token {t} forbidden"
            assert matcher.accept_token(t)
    report("xgrammar", vocab, prep, compiles, masks)


def report(engine: str, vocab: str, prep: float, compiles: list[float], masks: list[float]) -> None:
    masks_sorted = sorted(masks)
    p99 = masks_sorted[int(len(masks_sorted) * 0.99)]
    print(
        f"{engine:10} {vocab:8} tokenizer {ms(prep)}  compile median {ms(statistics.median(compiles))}"
        f" (first {ms(compiles[0])})  mask mean {us(statistics.fmean(masks))} p99 {us(p99)}"
        f" max {us(max(masks))}  ({len(masks)} masks)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", default="llguidance,xgrammar")
    parser.add_argument("--vocabs", default="bytes,smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    hf = smollm2_tokenizer() if "smollm2" in args.vocabs else None
    print(f"instance: {len(TEXT)} bytes, {len(hf.encode(TEXT)) if hf else '-'} SmolLM2 tokens")
    benches = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}
    for vocab in args.vocabs.split(","):
        for engine in args.engines.split(","):
            benches[engine](vocab, hf, args.rounds)


if __name__ == "__main__":
    main()
