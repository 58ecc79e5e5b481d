"""Tiny random Hugging Face checkpoints for the real-model tests, built locally (no downloads):
a byte-level BPE tokenizer trained with ``tokenizers`` on a few sentences, and a random Llama or
Qwen2 with ``save_pretrained``; plus a small driver that runs a ``CachedModel`` the way the
engine does (slots, staggered arrivals, chunked prefill, preemption, cancels)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.models.protocol import GREEDY, CachedModel, PrefillChunk, SamplingParams, StepBatch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Rome is the capital of Italy.",
    "A slot holds one request; the engine refills every freed slot before the next step.",
    "Streams of tokens arrive one by one, and the server sends them as events.",
] * 20
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(folder: Path) -> Any:
    """Trains a byte-level BPE (a few hundred tokens) and saves it as a transformers tokenizer
    whose eos is ``</s>`` (id 2), with a chat template. Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tok = _transformers().PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def save_tiny_model(
    folder: Path, *, family: str = "llama", vocab_size: int = 320, seed: int = 0
) -> Path:
    """A random 2-layer model (4 query heads, 2 KV heads, head dim 16) saved in float64 with a
    generation config whose eos ids are 2 and 4. ``family``: llama (tied embeddings), mistral
    or qwen2 (q/k/v biases, separate output embeddings)."""
    hf = _transformers()
    shape: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    config: Any
    model: Any
    if family == "llama":
        rope = {"rope_theta": 500.0, "rope_type": "default"}
        config = hf.LlamaConfig(**shape, tie_word_embeddings=True, rope_parameters=rope)
        model = hf.LlamaForCausalLM(config)
    elif family == "mistral":  # a sliding window wider than the context: full attention
        config = hf.MistralConfig(**shape, tie_word_embeddings=False, sliding_window=1024)
        model = hf.MistralForCausalLM(config)
    else:
        config = hf.Qwen2Config(**shape, tie_word_embeddings=False)
        model = hf.Qwen2ForCausalLM(config)
        with torch.no_grad():  # random (not zero) q/k/v biases, so they matter
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    model.generation_config = hf.GenerationConfig(bos_token_id=1, eos_token_id=[2, 4])
    model.to(torch.float64).save_pretrained(folder)
    return folder


def _transformers() -> Any:
    """The transformers module, untyped (its constructors have no annotations)."""
    import transformers

    return transformers


@dataclass
class DriverRequest:
    """One request in the driver: prompt + generated tokens, positions cached."""

    rid: str
    prompt: list[int]
    max_new: int
    sampling: SamplingParams = GREEDY
    generated: list[int] = field(default_factory=list)
    computed: int = 0
    slot: int = -1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


@dataclass
class Driver:
    """Runs requests through a cached model as the engine does: FIFO admission into free slots,
    at most ``chunk`` prompt tokens per request per step, releases on finish. ``preempt_at``
    (step -> request id, or None for the request admitted last, vLLM's victim) releases that
    request's slot and requeues it at the front, to be re-prefilled from position 0 with prompt +
    generated; ``cancel_at`` (step -> id, or None for the oldest running request) ends it."""

    model: CachedModel
    num_slots: int
    chunk: int = 1 << 30
    preempt_at: dict[int, str | None] = field(default_factory=dict)
    cancel_at: dict[int, str | None] = field(default_factory=dict)
    steps: int = 0
    preempted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    _admitted: list[str] = field(default_factory=list)

    def run(
        self, requests: Sequence[DriverRequest], arrivals: Sequence[int] | None = None
    ) -> dict[str, list[int]]:
        """``arrivals[i]``: the step at which ``requests[i]`` arrives (default 0). Returns the
        generated tokens per request id."""
        pending = sorted(zip(arrivals or [0] * len(requests), range(len(requests)), strict=True))
        waiting: list[DriverRequest] = []
        running: dict[int, DriverRequest] = {}
        done: dict[str, list[int]] = {}
        while pending or waiting or running:
            while pending and pending[0][0] <= self.steps:
                waiting.append(requests[pending.pop(0)[1]])
            self._interrupt(running, waiting, done)
            free = [s for s in range(self.num_slots) if s not in running]
            while waiting and free:
                request = waiting.pop(0)
                request.slot = free.pop(0)
                running[request.slot] = request
                self._admitted.append(request.rid)
            self._step(running, done)
            self.steps += 1
        return done

    def _interrupt(
        self,
        running: dict[int, DriverRequest],
        waiting: list[DriverRequest],
        done: dict[str, list[int]],
    ) -> None:
        for table, requeue in ((self.preempt_at, True), (self.cancel_at, False)):
            if self.steps not in table or not running:
                continue
            rid = table[self.steps]
            if rid is None:
                ranked = sorted(running.values(), key=lambda r: self._admitted.index(r.rid))
                rid = ranked[-1 if requeue else 0].rid
            victim = next((r for r in running.values() if r.rid == rid), None)
            if victim is None:
                continue
            del running[victim.slot]
            self.model.release(victim.slot)
            victim.computed = 0
            if requeue:
                self.preempted.append(victim.rid)
                waiting.insert(0, victim)
            else:
                self.cancelled.append(victim.rid)
                done[victim.rid] = victim.generated

    def _step(self, running: dict[int, DriverRequest], done: dict[str, list[int]]) -> None:
        decode: list[DriverRequest] = []
        chunks: list[tuple[DriverRequest, PrefillChunk]] = []
        # Decode slots in ascending order on even steps, descending (out of order) on odd ones.
        for slot in sorted(running, reverse=self.steps % 2 == 1):
            r = running[slot]
            tokens = r.tokens
            if r.generated and r.computed == len(tokens) - 1:
                decode.append(r)
                continue
            end = min(len(tokens), r.computed + self.chunk)
            piece = PrefillChunk(
                slot, tokens[r.computed : end], r.computed, end == len(tokens), r.sampling, r.rid
            )
            chunks.append((r, piece))
        batch = StepBatch(
            decode_slots=[r.slot for r in decode],
            decode_tokens=[r.tokens[-1] for r in decode],
            decode_sampling=[r.sampling for r in decode],
            decode_request_ids=[r.rid for r in decode],
            prefills=[piece for _, piece in chunks],
        )
        out = iter(self.model.step(batch))
        sampled = decode + [r for r, piece in chunks if piece.sample]
        for r in decode:
            r.computed += 1
        for r, piece in chunks:
            r.computed = piece.start + len(piece.token_ids)
        for r in sampled:
            r.generated.append(next(out))
            if len(r.generated) == r.max_new:
                del running[r.slot]
                self.model.release(r.slot)
                done[r.rid] = r.generated


def random_prompts(count: int, vocab_size: int, seed: int = 1) -> list[list[int]]:
    """``count`` prompts of 1 to 40 random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(count)]
