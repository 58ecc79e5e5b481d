"""The server's settings in the engine's terms: ``engine_config`` builds the ``EngineConfig``
(the scheduler's ``SchedulerConfig`` and the engine's own limits) once, and the engine hands
it to its scheduler whole. Each field of ``EngineConfig`` or ``PolicyConfig`` named like a
setting takes that setting's value (the same name means the same thing), so a new scheduler
setting is a field there and a flag of the same name in ``app/config.py``, with no code here."""

from __future__ import annotations

import dataclasses
from typing import Any

from app.config import Settings
from app.engine.core import EngineConfig
from app.engine.policies import PolicyConfig, PolicyName
from app.engine.scheduler import BatchingPolicy
from app.engine.step_clock import StepCosts, StepTimeModel


def named_like_settings(cls: type[Any], settings: Settings) -> dict[str, Any]:
    """The settings named like a field of the dataclass ``cls``, by name."""
    names = (field.name for field in dataclasses.fields(cls))
    return {name: getattr(settings, name) for name in names if name in type(settings).model_fields}


def step_costs(settings: Settings) -> StepTimeModel:
    """The step clock: the linear one of the ``--mock-*-ms`` flags, or with --model-config
    the physics step time (app/step_time)."""
    lora_ms = settings.lora_switch_ms if settings.enable_lora else 0.0
    if settings.model_config_file is not None:
        from app.step_time.settings import physics_step_time

        return physics_step_time(
            settings.model_config_file, settings.gpu, settings.tensor_parallel_size, lora_ms / 1e3
        )
    return StepCosts(
        step_ms=settings.mock_step_ms,
        prefill_token_ms=settings.mock_prefill_ms,
        decode_token_ms=settings.mock_per_seq_ms,
        lora_load_ms=lora_ms,
    )


def physics_admission(settings: Settings) -> dict[str, Any]:
    """With --model-config: the imitated server's API time before a request may be scheduled,
    and its late admission (what ``simulate`` replays; docs/fidelity.md)."""
    if settings.model_config_file is None:
        return {}
    from app.step_time.physics import DEFAULT_CALIBRATION

    return {"admission_delay": DEFAULT_CALIBRATION.api_ms / 1000, "late_admission": True}


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's limits, scheduling policy and step clock from the settings. Besides the
    same-named ones: ``policy`` is --policy's ``PolicyConfig`` (the flag is only its name), the KV
    capacity defaults to a whole context per slot (it never binds), LoRA's bound applies with
    --enable-lora only."""
    whole_contexts = settings.num_slots * -(-settings.max_model_len // settings.block_size)
    policy = PolicyName(settings.policy)
    explicit = {
        "batching": BatchingPolicy(settings.batching),
        "kv_cache_tokens": settings.kv_cache_tokens or whole_contexts * settings.block_size,
        "policy": PolicyConfig(policy, **named_like_settings(PolicyConfig, settings)),
        "record_kv_events": settings.kv_events_endpoint is not None,
        "max_loras": settings.max_loras if settings.enable_lora else None,
        "step_costs": step_costs(settings),
        "step_jitter": settings.mock_jitter,
        "kv_hold_seconds": settings.kv_transfer_hold_s,  # P/D: a prefill's blocks held
        **physics_admission(settings),
    }
    return EngineConfig(**(named_like_settings(EngineConfig, settings) | explicit))
