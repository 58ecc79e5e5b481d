"""LoRA in serving: the adapters loaded at start (``--lora-modules``) and the one a request's
``model`` names."""

from __future__ import annotations

from app.config import Settings
from app.lora import LoRAError, LoRARegistry, parse_module


def start_loras(settings: Settings) -> LoRARegistry:
    """The registry with ``--lora-modules`` loaded (with ``--enable-lora``); ``LoRAError``
    naming the module that cannot load."""
    loras = LoRARegistry(settings.model_name, settings.max_cpu_loras or settings.max_loras)
    for spec in settings.lora_modules if settings.enable_lora else ():
        try:
            loras.load(*parse_module(spec))
        except LoRAError as err:  # refused at start, the module named
            raise LoRAError(f"--lora-modules {spec}: {err}", err.kind) from None
    return loras


def lora_named(settings: Settings, loras: LoRARegistry, model: str | None) -> str | None:
    """The LoRA adapter a request's ``model`` names (None: the base model, or unset);
    ``LookupError`` if it names neither."""
    if model is None or model == settings.model_name:
        return None
    if settings.enable_lora and model in loras.adapters:
        return model
    raise LookupError(model)
