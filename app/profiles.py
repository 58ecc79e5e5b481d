"""GPU profiles: presets that make the step clock and the limits imitate one model on one GPU.

A profile names the step clock's coefficients, fitted on a real vLLM server by BLIS
(inference-sim/inference-sim: b0 us per step, b1 per prefill token, b2 per decode token), and
the hardware the KV capacity is computed from:

    kv_cache_tokens = (0.9 * GPU memory - weight bytes) / KV bytes per token

(vLLM's default ``gpu_memory_utilization`` of 0.9; activations and CUDA graphs are neglected).
Memory sizes are decimal (an "80 GB" GPU holds 80e9 bytes here). ``--profile`` also sets
``PROFILE_LIMITS`` (vLLM's online defaults on these GPUs); every value is overridden by a flag
the user sets (see ``app.config.Settings``). docs/fidelity.md shows the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory for weights + KV cache
BYTES_PER_PARAM = 2  # bf16 weights
GB = 10**9


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """One model on one GPU setup: step-clock coefficients (microseconds) and memory."""

    name: str
    step_us: float  # b0: per step
    prefill_token_us: float  # b1: per prefill token
    decode_token_us: float  # b2: per decode token
    params: int  # model parameters (bf16 weights)
    layers: int
    kv_heads: int
    head_dim: int
    gpus: int
    gpu_gb: int  # memory per GPU, decimal GB

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, bf16, for every layer and KV head (summed over the tensor-parallel GPUs)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES_PER_PARAM

    @property
    def weight_bytes(self) -> int:
        return self.params * BYTES_PER_PARAM

    @property
    def kv_budget_bytes(self) -> int:
        """GPU memory vLLM gives the KV cache: 90% of it, less the weights."""
        return int(GPU_MEMORY_UTILIZATION * self.gpus * self.gpu_gb * GB) - self.weight_bytes

    @property
    def kv_cache_tokens(self) -> int:
        return self.kv_budget_bytes // self.kv_bytes_per_token


# The limits every profile sets unless a flag overrides them (vLLM's online defaults).
PROFILE_LIMITS = {"num_slots": 256, "max_model_len": 8192, "max_num_batched_tokens": 8192}

PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile("llama3.1-8b-h100", 5753, 17.3, 6.0, 8_030_261_248, 32, 8, 128, 1, 80),
        GpuProfile("llama3.1-8b-a100", 16442, 47.8, 18.2, 8_030_261_248, 32, 8, 128, 1, 80),
        GpuProfile("llama3.3-70b-h100-tp4", 12601, 76.4, 66.8, 70_553_706_496, 80, 8, 128, 4, 80),
        GpuProfile("qwen3-14b-h100", 13578, 39.4, 27.3, 14_768_307_200, 40, 8, 128, 1, 80),
    )
}
ProfileName = Literal[
    "llama3.1-8b-h100", "llama3.1-8b-a100", "llama3.3-70b-h100-tp4", "qwen3-14b-h100"
]  # the keys of PROFILES (a test checks it), spelled out for the type checker
PROFILE_NAMES: tuple[str, ...] = get_args(ProfileName)


def profile_settings(name: str) -> dict[str, float | int]:
    """The ``Settings`` values the profile ``name`` presets (step clock in ms, limits, KV)."""
    p = PROFILES[name]
    return {
        "mock_step_ms": p.step_us / 1000,
        "mock_prefill_ms": p.prefill_token_us / 1000,
        "mock_per_seq_ms": p.decode_token_us / 1000,
        "kv_cache_tokens": p.kv_cache_tokens,
        **PROFILE_LIMITS,
    }
