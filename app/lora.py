"""LoRA adapters, simulated for the mocks: which adapters are loaded, by name.

An adapter here is a name, a path, an integer id and a parent (the base model). Loading one
checks the name, the path and the bounds, as vLLM's ``/v1/load_lora_adapter`` does; what an
adapter does to tokens is not simulated (the mocks' output is the same), but what it does to
scheduling is: a batch runs at most ``--max-loras`` distinct adapters (the scheduler's rule), and
``--lora-switch-ms`` charges the step clock for loading one into a batch slot.

A name matches ``NAME_PATTERN`` (letters, digits and ``_ . : / @ + -``, at most 128
characters: a Hugging Face repo id fits; no control, separator or comma, so it is safe in a
log line and in ``vllm:lora_requests_info``'s comma-separated labels). A path is loadable when
it is a directory holding a readable ``adapter_config.json`` whose text is a JSON object, as a
PEFT adapter's is (the weights beside it are not read: the adapters are simulated). Every other
path (missing, unreadable, a file, too long, not an adapter) gets one and the same answer, so a
client learns nothing about the server's files.

Errors are ``LoRAError`` with a ``kind`` the API maps to its status: ``not_found`` (404: no such
adapter to unload), ``not_loadable``, ``invalid_name``, ``duplicate`` and ``too_many`` (400).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/@+-]{0,127}")
MAX_PATH = 4096  # characters of a path (Linux's PATH_MAX); longer is not loadable
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json past this is not an adapter's
CANNOT_LOAD = (
    "no LoRA adapter loads from this path (it must be a readable directory holding a PEFT "
    "adapter_config.json)"
)


class LoRAError(Exception):
    """A load or unload that cannot be done; ``kind``: not_found, not_loadable, invalid_name,
    duplicate, too_many."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    path: str
    id: int
    parent: str


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter (None: it can): see ``NAME_PATTERN``."""
    if NAME_PATTERN.fullmatch(name):
        return None
    return (
        "a LoRA adapter name is 1-128 of the characters A-Z a-z 0-9 _ . : / @ + - (not "
        "starting with . : / @ + -)"
    )


def loadable(path: str) -> bool:
    """Whether ``path`` is a directory holding a readable ``adapter_config.json`` that is a
    JSON object (never raises: any failure is just "not loadable")."""
    if len(path) > MAX_PATH:
        return False
    config_path = Path(path) / "adapter_config.json"
    try:
        if not config_path.is_file():  # (a FIFO or device would block the open or the read)
            return False
        with config_path.open("rb") as config:
            text = config.read(MAX_CONFIG_BYTES + 1)
        return len(text) <= MAX_CONFIG_BYTES and isinstance(json.loads(text), dict)
    except (OSError, ValueError):  # missing, unreadable, a file, too long, not JSON, a NUL
        return False


def parse_module(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` (vLLM's ``--lora-modules`` form) as (name, path); ValueError if not, or
    if the name is not one ``name_problem`` accepts."""
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{spec!r} is not NAME=PATH")
    problem = name_problem(name.strip())
    if problem is not None:
        raise ValueError(f"{spec!r}: {problem}")
    return name.strip(), path.strip()


class LoRARegistry:
    """The loaded adapters, at most ``max_cpu_loras`` of them (``--max-cpu-loras``)."""

    def __init__(self, base_model: str, max_cpu_loras: int) -> None:
        self.base_model = base_model
        self.max_cpu_loras = max_cpu_loras
        self.adapters: dict[str, LoRAAdapter] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Load adapter ``name`` from ``path`` (see ``loadable``); ``LoRAError`` for a name
        ``name_problem`` refuses, a duplicate name, the base model's name, a path that is not
        loadable (one message whatever the reason) or past ``max_cpu_loras``."""
        problem = name_problem(name)
        if problem is not None:
            raise LoRAError(problem, "invalid_name")
        if name in self.adapters:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.", "duplicate")
        if name == self.base_model:
            raise LoRAError(f"'{name}' is the base model's name", "duplicate")
        if not loadable(path):
            raise LoRAError(CANNOT_LOAD, "not_loadable")
        if len(self.adapters) >= self.max_cpu_loras:
            raise LoRAError(
                f"{len(self.adapters)} LoRA adapters are loaded, the most --max-cpu-loras "
                f"allows: unload one first",
                "too_many",
            )
        adapter = LoRAAdapter(name, path, next(self._ids), self.base_model)
        self.adapters[name] = adapter
        return adapter

    def named_by(self, model: str | None, enabled: bool) -> str | None:
        """The adapter a request's ``model`` names (None: the base model, or unset);
        ``LookupError`` if it names neither (an adapter too, unless ``enabled``)."""
        if model is None or model == self.base_model:
            return None
        if enabled and model in self.adapters:
            return model
        raise LookupError(model)

    def unload(self, name: str) -> LoRAAdapter:
        """Forget ``name``: new requests naming it get 404; requests already using it finish
        (vLLM's answer to unloading an adapter in use: 200)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.", "not_found")
        return adapter


def start_registry(base_model: str, max_cpu_loras: int, modules: list[str]) -> LoRARegistry:
    """A registry with ``modules`` (``--lora-modules`` specs) loaded; ``LoRAError`` naming the
    module that cannot load."""
    loras = LoRARegistry(base_model, max_cpu_loras)
    for spec in modules:
        try:
            loras.load(*parse_module(spec))
        except LoRAError as err:  # refused at start, the module named
            raise LoRAError(f"--lora-modules {spec}: {err}", err.kind) from None
    return loras
