"""A simulated LoRA adapter on disk: a folder with a PEFT ``adapter_config.json`` (what
``app.lora.loadable`` asks of a path; the weights are never read)."""

from __future__ import annotations

import json
from pathlib import Path


def adapter_dir(path: Path) -> Path:
    """Make ``path`` an adapter folder (created if missing); returns it."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
