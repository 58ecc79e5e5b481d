"""A real model for the server: the name it is served under, the settings it implies once
loaded, and the load itself on a daemon thread (so the server answers ``/health`` with 503
``loading`` meanwhile, and a shutdown never waits for a load in progress)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING

from app.config import Settings
from app.models.hf import is_real_model, served_name

if TYPE_CHECKING:
    from app.models.hf import LoadedModel


def wants_real_model(settings: Settings) -> bool:
    return is_real_model(settings.model)


def named(settings: Settings) -> Settings:
    """``settings`` with ``model_name`` set to the real model's name unless the user chose one
    (a mock's settings are returned as they are)."""
    if "model_name" in settings.model_fields_set or not wants_real_model(settings):
        return settings
    return settings.model_copy(update={"model_name": served_name(settings.model)})


def sized(settings: Settings, loaded: LoadedModel) -> Settings:
    """``settings`` with the context length and KV capacity the loaded model's cache has."""
    return settings.model_copy(
        update={
            "max_model_len": loaded.max_model_len,
            "kv_cache_tokens": loaded.kv_capacity_tokens,
        }
    )


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
