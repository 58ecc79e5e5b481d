"""The model a server runs: a built-in mock at once, or a real model (``--model smollm2`` or
``hf:PATH``) loaded on a daemon thread (so the server answers ``/health`` with 503 ``loading``
meanwhile, and a shutdown never waits for a load in progress), with its tokenizer and grammar
compiler, and the name it is served under."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass

from app.config import Settings
from app.engine.errors import EngineError
from app.models.cached_mock import CachedMockModel
from app.models.hf import LoadedModel, ModelLoadError, is_real_model, served_name
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.models.protocol import Model
from app.models.tokenizer import ByteTokenizer, Tokenizer
from app.structured.grammar import GrammarBudget, GrammarCompiler

log = logging.getLogger("slotserve.serving")


class ModelLoadingError(EngineError):
    """The real model is still loading (or failed to load): nothing can be served yet."""


class ModelLoadFailedError(ModelLoadingError):
    """The real model failed to load: nothing will be served (retrying does not help)."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """A model ready to serve, one per data-parallel rank (``models``; the mocks only run more
    than one), with the tokenizer and grammar compiler of their vocabulary."""

    models: list[Model]
    tokenizer: Tokenizer
    grammars: GrammarCompiler


def build_model(settings: Settings, tokenizer: Tokenizer | None = None) -> Model:
    """The built-in mock named by ``settings.model``; with ``tokenizer`` (``--tokenizer``) it
    writes single-token words of that vocabulary and stops at its EOS."""
    language = MockLanguage(seed=settings.seed, stop_probability=settings.mock_stop_probability)
    if tokenizer is not None:
        from app.models.hf.tokenizer import HFTokenizer
        from app.models.vocabulary import word_ids

        assert isinstance(tokenizer, HFTokenizer)
        language = MockLanguage(
            tokenizer.vocab_size,
            tokenizer.eos_token_id,
            settings.seed,
            settings.mock_stop_probability,
            text=False,
            words=word_ids(tokenizer),
        )
    if settings.model == "mock":
        return MockModel(language)
    return CachedMockModel(settings.num_slots, language)


def grammar_budget(settings: Settings) -> GrammarBudget:
    """The CPU time a request's grammar work may take (``--max-grammar-ms-per-*``)."""
    return GrammarBudget(settings.max_grammar_ms_per_token, settings.max_grammar_ms_per_request)


def load_mock(settings: Settings, model: Model | None = None) -> Loaded:
    """``model`` (None: the built-in mock ``settings`` name) on rank 0, the built-in mock on
    every other rank, with ``--tokenizer``'s tokenizer (unset: the mocks' byte tokenizer)."""
    words: Tokenizer | None = None
    if settings.tokenizer is not None:
        from app.models.vocabulary import load_tokenizer

        words = load_tokenizer(settings.tokenizer)
    models = [model if model is not None else build_model(settings, words)] + [
        build_model(settings, words) for _ in range(1, settings.data_parallel_size)
    ]
    tokenizer = words or ByteTokenizer()
    return Loaded(models, tokenizer, GrammarCompiler(tokenizer, grammar_budget(settings)))


def named(settings: Settings) -> Settings:
    """``settings`` with ``model_name`` set to the real model's name unless the user chose one
    (a mock's settings are returned as they are)."""
    if "model_name" in settings.model_fields_set or not is_real_model(settings.model):
        return settings
    return settings.model_copy(update={"model_name": served_name(settings.model)})


async def load(settings: Settings) -> LoadedModel:
    """``load_model`` for ``settings`` on a daemon thread. Raises its ``ModelLoadError``."""
    from app.models.hf import load_model

    loop = asyncio.get_running_loop()
    done: asyncio.Future[LoadedModel] = loop.create_future()

    def settle(result: LoadedModel | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            assert result is not None
            done.set_result(result)

    def report(result: LoadedModel | None, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    def work() -> None:
        try:
            loaded = load_model(
                settings.model,
                dtype=settings.dtype,
                device=settings.device,
                num_slots=settings.num_slots,
                max_model_len=settings.max_model_len,
                kv_cache_memory=int(settings.kv_cache_memory),
                cache_dir=settings.model_cache_dir,
                threads=settings.torch_threads,
                quantization=settings.quantization,
                compile=settings.compile,
            )
        except BaseException as exc:  # reported to the awaiting task, not lost in the thread
            report(None, exc)
        else:
            report(loaded, None)

    threading.Thread(target=work, name="slotserve-model-load", daemon=True).start()
    return await done


async def load_real(settings: Settings) -> tuple[Settings, Loaded]:
    """The real model ``settings`` name, loaded off the event loop, and ``settings`` with the
    context length and KV capacity its cache has; ``ModelLoadFailedError`` (logged; its
    message says why) if it cannot be."""
    try:
        loaded = await load(settings)
    except ModelLoadError as exc:
        log.error("model %s not loaded: %s", settings.model, exc)
        raise ModelLoadFailedError(str(exc)) from None
    except Exception as exc:
        log.exception("model %s not loaded", settings.model)
        raise ModelLoadFailedError(repr(exc)) from None
    sized = {"max_model_len": loaded.max_model_len, "kv_cache_tokens": loaded.kv_capacity_tokens}
    settings = settings.model_copy(update=sized)
    try:  # the grammar engine's vocabulary: ~1 s for a 49k vocabulary, off the event loop
        budget = grammar_budget(settings)
        grammars = await asyncio.to_thread(GrammarCompiler, loaded.tokenizer, budget)
    except Exception as exc:
        log.exception("model %s not loaded", settings.model)
        raise ModelLoadFailedError(
            f"the grammar engine cannot read the tokenizer: {exc!r}"
        ) from None
    return settings, Loaded([loaded.model], loaded.tokenizer, grammars)
