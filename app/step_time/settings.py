"""What ``--model-config``, ``--gpu`` and ``--tensor-parallel-size`` preset for ``serve``.

vLLM's defaults where they shape latency, for every field the user did not set: the limits of
``app.profiles.PROFILE_LIMITS`` (vLLM's online defaults on these GPUs; ``max_model_len`` is the
model's ``max_position_embeddings`` when its config has one), prefix caching on (vLLM v1's
default), and the KV capacity vLLM would get on that hardware (``physics.kv_cache_tokens``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.step_time.gpus import UnknownGpuError, gpu
from app.step_time.model_config import ModelConfigError, ModelShape, load_model_config
from app.step_time.physics import PhysicsStepTime, kv_cache_tokens, require_kv_room


def load_shape(path: str | Path, gpu_name: str, tensor_parallel: int) -> ModelShape:
    """The model's shape, with the GPU and the tensor-parallel size checked; ``ValueError``
    naming the flag otherwise."""
    try:
        gpu(gpu_name)
        shape = load_model_config(path)
        shape.check_tensor_parallel(tensor_parallel)
    except (ModelConfigError, UnknownGpuError) as exc:
        raise ValueError(str(exc)) from exc
    return shape


def only_with_model_config(flags: list[str]) -> None:
    """``ValueError`` naming ``flags``, the flags given that apply only with --model-config
    (none: nothing to say)."""
    if flags:
        verb = "apply" if len(flags) > 1 else "applies"
        raise ValueError(f"{' and '.join(flags)} {verb} only with --model-config")


def physics_presets(
    shape: ModelShape,
    gpu_name: str,
    tensor_parallel: int,
    chosen: dict[str, Any],
    block_size: int = 16,
) -> dict[str, Any]:
    """Settings values for the fields not in ``chosen`` (the user's), given those that are;
    ``ValueError`` if the weights leave no room for a KV cache (``physics.require_kv_room``) and
    the user set no ``kv_cache_tokens``."""
    from app.profiles import PROFILE_LIMITS

    presets: dict[str, Any] = {"enable_prefix_caching": True, **PROFILE_LIMITS}
    if shape.max_position is not None:
        presets["max_model_len"] = shape.max_position
    merged = presets | chosen
    device = gpu(gpu_name)
    kv = kv_cache_tokens(
        shape, device, tensor_parallel, merged["max_num_batched_tokens"], merged["num_slots"]
    )
    if "kv_cache_tokens" not in chosen:  # (0 would mean "unset": unlimited KV)
        require_kv_room(kv, block_size, shape, device, tensor_parallel)
    presets["kv_cache_tokens"] = kv
    return {k: v for k, v in presets.items() if k not in chosen}


def physics_step_time(
    path: str | Path, gpu_name: str, tensor_parallel: int, lora_load_s: float = 0.0
) -> PhysicsStepTime:
    shape = load_shape(path, gpu_name, tensor_parallel)
    return PhysicsStepTime(shape, gpu(gpu_name), tensor_parallel, lora_load_s=lora_load_s)
