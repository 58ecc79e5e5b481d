"""The server's settings in the engine's terms: its limits, scheduling policy and step clock."""

from __future__ import annotations

from typing import Any

from app.config import Settings
from app.engine.core import EngineConfig
from app.engine.policies import PolicyConfig, PolicyName
from app.engine.scheduler import BatchingPolicy
from app.engine.step_clock import StepCosts, StepTimeModel


def default_kv_cache_tokens(settings: Settings) -> int:
    """Room for every slot to hold a whole context, in whole blocks: it never binds."""
    blocks_per_slot = -(-settings.max_model_len // settings.block_size)
    return settings.num_slots * blocks_per_slot * settings.block_size


def policy_config(settings: Settings) -> PolicyConfig:
    """The scheduling policy and its knobs from the settings."""
    return PolicyConfig(
        name=PolicyName(settings.policy),
        max_overtakes=settings.max_overtakes,
        preemption_threshold=settings.preemption_threshold,
        preemption_delay=settings.preemption_delay,
        mlfq_levels=settings.mlfq_levels,
        mlfq_quantum=settings.mlfq_quantum,
        mlfq_aging_seconds=settings.mlfq_aging_seconds,
        mlfq_skip_join_tokens=settings.mlfq_skip_join_tokens,
        fair_prompt_weight=settings.fair_prompt_weight,
        fair_output_weight=settings.fair_output_weight,
        fair_preemption=settings.fair_preemption,
        fair_preemption_margin=settings.fair_preemption_margin,
    )


def physics_admission(settings: Settings) -> dict[str, Any]:
    """With --model-config: the imitated server's API time before a request may be scheduled,
    and its late admission (what ``simulate`` replays; docs/fidelity.md)."""
    if settings.model_config_file is None:
        return {}
    from app.step_time.physics import DEFAULT_CALIBRATION

    return {"admission_delay": DEFAULT_CALIBRATION.api_ms / 1000, "late_admission": True}


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's limits and step clock from the settings."""
    lora_ms = settings.lora_switch_ms if settings.enable_lora else 0.0
    costs: StepTimeModel = StepCosts(
        step_ms=settings.mock_step_ms,
        prefill_token_ms=settings.mock_prefill_ms,
        decode_token_ms=settings.mock_per_seq_ms,
        lora_load_ms=lora_ms,
    )
    if settings.model_config_file is not None:  # the physics step time (app/step_time)
        from app.step_time.settings import physics_step_time

        costs = physics_step_time(
            settings.model_config_file, settings.gpu, settings.tensor_parallel_size, lora_ms / 1e3
        )
    return EngineConfig(
        num_slots=settings.num_slots,
        max_waiting=settings.max_waiting,
        policy=BatchingPolicy(settings.batching),
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_prefill_chunk=settings.max_prefill_chunk,
        block_size=settings.block_size,
        kv_cache_tokens=settings.kv_cache_tokens or default_kv_cache_tokens(settings),
        max_model_len=settings.max_model_len,
        scheduling=policy_config(settings),
        enable_prefix_caching=settings.enable_prefix_caching,
        kv_events=settings.kv_events_endpoint is not None,
        max_loras=settings.max_loras if settings.enable_lora else None,
        step_costs=costs,
        step_jitter=settings.mock_jitter,
        **physics_admission(settings),
        seed=settings.seed,
    )
