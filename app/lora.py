"""LoRA adapters, simulated for the mocks: which adapters are loaded, by name.

An adapter here is a name, a path that must exist, an integer id and a parent (the base model).
Loading one checks the path and the bounds, as vLLM's ``/v1/load_lora_adapter`` does; what an
adapter does to tokens is not simulated (the mocks' output is the same), but what it does to
scheduling is: a batch runs at most ``--max-loras`` distinct adapters (the scheduler's rule), and
``--lora-switch-ms`` charges the step clock for loading one into a batch slot.

Errors are ``LoRAError`` with a ``kind`` the API maps to its status: ``not_found`` (404: no such
adapter, or no file at its path, vLLM's "No adapter found"), ``duplicate`` and ``too_many``
(400).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path


class LoRAError(Exception):
    """A load or unload that cannot be done; ``kind``: not_found, duplicate, too_many."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    path: str
    id: int
    parent: str


def parse_module(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` (vLLM's ``--lora-modules`` form) as (name, path); ValueError if not."""
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{spec!r} is not NAME=PATH")
    return name.strip(), path.strip()


class LoRARegistry:
    """The loaded adapters, at most ``max_cpu_loras`` of them (``--max-cpu-loras``)."""

    def __init__(self, base_model: str, max_cpu_loras: int) -> None:
        self.base_model = base_model
        self.max_cpu_loras = max_cpu_loras
        self.adapters: dict[str, LoRAAdapter] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Load adapter ``name`` from ``path`` (which must exist); ``LoRAError`` for a
        duplicate name, the base model's name, a missing path or past ``max_cpu_loras``."""
        if name in self.adapters:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.", "duplicate")
        if name == self.base_model:
            raise LoRAError(f"'{name}' is the base model's name", "duplicate")
        if not Path(path).exists():
            raise LoRAError(f"No adapter found for {path}", "not_found")
        if len(self.adapters) >= self.max_cpu_loras:
            raise LoRAError(
                f"{len(self.adapters)} LoRA adapters are loaded, the most --max-cpu-loras "
                f"allows: unload one first",
                "too_many",
            )
        adapter = LoRAAdapter(name, path, next(self._ids), self.base_model)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        """Forget ``name``: new requests naming it get 404; requests already using it finish
        (vLLM's answer to unloading an adapter in use: 200)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.", "not_found")
        return adapter
