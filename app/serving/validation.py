"""A request into engine terms: ``GenerationParams`` checked against the model (vocabulary,
sampling, context length, KV capacity, priority bound, grammar) and made a ``Sequence``."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid
from dataclasses import dataclass, field

from app.config import Settings
from app.engine.kv_books import KVBooks
from app.engine.stop_strings import StopStrings
from app.engine.types import Sequence
from app.models.bans import forbids_everything
from app.models.protocol import DEFAULT_SAMPLING, Model, SamplingParams
from app.models.tokenizer import Tokenizer
from app.structured.constraint import Constraint, ConstraintError
from app.structured.grammar import GrammarCompiler, GrammarSpend


class InvalidRequestError(ValueError):
    """A request the model cannot take (empty prompt, unknown token id, too long for the
    context): the client's mistake. ``param`` names the field, ``code`` the kind."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(slots=True)
class GenerationParams:
    """A validated-shape request, before the context-length and vocabulary checks."""

    prompt: list[int]
    max_tokens: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str | None = None
    priority: int = 0
    sampling: SamplingParams = DEFAULT_SAMPLING
    bad_words: list[str] = field(default_factory=list)  # text: tokenized into sampling here
    user: str | None = None  # the request's own user field
    # The named API key the request authenticated with (None: no named keys). When set, it is
    # the request's user for --policy fair (a client cannot override it) and
    # --max-priority-for bounds its priority.
    key_name: str | None = None
    # What the output must match (structured outputs, a tool call), and the request field that
    # set it (named in the 400 if it does not compile).
    constraint: Constraint | None = None
    constraint_param: str = "response_format"
    lora: str | None = None  # the LoRA adapter the request names (None: the base model)
    # prefill/decode disaggregation (app/kv_transfer): hold the prompt's blocks for a remote
    # decoder when the request ends by length; the prompt's leading tokens whose KV arrived
    remote_decode: bool = False
    remote_tokens: int = 0
    # The request's grammar time, shared by the choices copied from these params (n, prompts):
    # the per-request grammar budget bounds the request, not each choice.
    grammar_spend: GrammarSpend = field(default_factory=GrammarSpend)


def context_length_error(prompt_len: int, max_tokens: int, context: int) -> InvalidRequestError:
    """A prompt plus ``max_tokens`` that does not fit in the context length."""
    return InvalidRequestError(
        f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length "
        f"of {context} tokens",
        "max_tokens", "context_length_exceeded",
    )  # fmt: skip


def output_tokens(settings: Settings, prompt_len: int, requested: int | None) -> int:
    """The most tokens a request may generate after a ``prompt_len``-token prompt:
    ``requested``, or the default capped by the room left, never past the context (a request
    asking for more is refused by ``Validator.sequence``)."""
    room = max(settings.max_model_len - prompt_len, 0)
    return min(room, settings.default_max_tokens if requested is None else requested)


def supports_sampling(model: object) -> bool:
    """Whether ``model`` honours per-request logits processors and log probabilities."""
    return callable(getattr(model, "step_sampled", getattr(model, "next_tokens_for", None)))


@functools.lru_cache(maxsize=256)
def _shared_stop_set(ids: tuple[int, ...]) -> frozenset[int]:
    """One frozenset per distinct stop list (almost always just EOS), shared by requests."""
    return frozenset(ids)


@dataclass(frozen=True, slots=True)
class Validator:
    """The loaded model, its tokenizer and grammar compiler, and the checks a request passes
    against them before it reaches the engine. ``books``: rank 0's KV capacity."""

    settings: Settings
    model: Model
    tokenizer: Tokenizer
    grammars: GrammarCompiler
    books: KVBooks
    priority_limits: dict[str, int]  # --max-priority-for

    async def precompile(self, constraint: Constraint | None, param: str) -> None:
        """Compile ``constraint`` on a worker thread (a large schema takes a while: never on the
        event loop), so ``sequence`` finds it compiled; ``InvalidRequestError`` naming
        ``param`` if it does not compile."""
        if constraint is None:
            return
        try:
            await asyncio.to_thread(self.grammars.matcher, constraint)
        except ConstraintError as err:
            raise InvalidRequestError(f"{param}: {err}", param, "invalid_grammar") from None

    def sequence(self, params: GenerationParams, id_prefix: str) -> Sequence:
        """``params`` as a sequence; ``InvalidRequestError`` if it cannot run."""
        if not params.prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt", "empty_prompt")
        self._check_vocabulary(params.prompt, "prompt")
        self._check_vocabulary(params.stop_token_ids, "stop_token_ids")
        sampling = self._sampling(params)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.tokenizer.stop_token_ids)
        text_stop = None
        if params.stop_strings:
            decoder = self.tokenizer.stream_decoder()
            text_stop = StopStrings(params.stop_strings, decoder, sampling.min_tokens)
        vocab = self.tokenizer.vocab_size
        blame = forbids_everything(sampling, stops, vocab) if sampling.constrains_choice else None
        if blame is not None:
            raise InvalidRequestError(
                f"{blame}: no token is left to sample (allowed_token_ids, logit_bias -100, "
                "bad_words and, before min_tokens, the stop tokens forbid every token)",
                blame, "invalid_value",
            )  # fmt: skip
        max_tokens = self._max_tokens(len(params.prompt), params.max_tokens)
        if sampling.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({sampling.min_tokens}) exceeds max_tokens ({max_tokens})",
                "min_tokens", "invalid_value",
            )  # fmt: skip
        constraint = None
        if params.constraint is not None:
            try:
                constraint = self.grammars.matcher(params.constraint, params.grammar_spend)
            except ConstraintError as err:
                raise InvalidRequestError(
                    f"{params.constraint_param}: {err}", params.constraint_param, "invalid_grammar"
                ) from None
        return Sequence(
            request_id=params.request_id or f"{id_prefix}-{uuid.uuid4().hex}",
            tokens=list(params.prompt),
            max_tokens=max_tokens,
            stop_token_ids=_shared_stop_set(tuple(sorted(stops))),
            priority=self._priority(params),
            sampling=sampling,
            stop=text_stop,
            constraint=constraint,
            user=params.key_name if params.key_name is not None else params.user,
            lora=params.lora,
            remote_decode=params.remote_decode,
            remote_tokens=params.remote_tokens,
        )

    def _sampling(self, params: GenerationParams) -> SamplingParams:
        """The request's sampling parameters, checked against the vocabulary and the model,
        with its ``bad_words`` tokenized (each alone and after a space, as vLLM does)."""
        sampling = params.sampling
        if sampling.plain and not params.bad_words:
            return sampling
        self._check_vocabulary([token for token, _ in sampling.logit_bias], "logit_bias")
        self._check_vocabulary(list(sampling.allowed_token_ids or ()), "allowed_token_ids")
        if params.bad_words:
            encode = self.tokenizer.encode
            words = {tuple(ids) for w in params.bad_words for ids in (encode(w), encode(" " + w))}
            sampling = dataclasses.replace(sampling, bad_words=tuple(w for w in words if w))
        if not supports_sampling(self.model):
            raise InvalidRequestError(
                "this model cannot honour logits processors or log probabilities (it has no "
                "step_sampled / next_tokens_for)",
                "logprobs" if sampling.logprobs is not None else "logit_bias",
                "unsupported_parameter",
            )  # fmt: skip
        return sampling

    def _priority(self, params: GenerationParams) -> int:
        """The request's priority. ``--max-priority-for``: a named key may not claim a better
        (lower) priority than its bound (400); the default, 0, becomes the bound."""
        best = None if params.key_name is None else self.priority_limits.get(params.key_name)
        if best is None or params.priority >= best:
            return params.priority
        if params.priority == 0:
            return best
        raise InvalidRequestError(
                f"priority {params.priority} is better than API key {params.key_name!r} may "
                f"claim (at best {best}; lower is better)",
                "priority", "priority_not_allowed",
            )  # fmt: skip

    def _check_vocabulary(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise InvalidRequestError(
                f"token id {bad} in {param} is outside the vocabulary [0, {vocab})",
                param, "invalid_token_id",
            )  # fmt: skip

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """``requested``, or the default capped by the room left; 400 past the context."""
        context = self.settings.max_model_len
        room = context - prompt_len
        default = output_tokens(self.settings, prompt_len, None)
        max_tokens, books = default if requested is None else requested, self.books
        needed = prompt_len + max_tokens - 1  # the last token is never fed back
        if room >= 0 and max_tokens <= room and not books.fits_ever(needed):
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the KV cache "
                f"({books.capacity_tokens} tokens)",
                "max_tokens", "context_length_exceeded",
            )  # fmt: skip
        if room < 0 or max_tokens > room:
            raise context_length_error(prompt_len, max_tokens, context)
        return max_tokens
