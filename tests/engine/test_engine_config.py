"""The settings reach the engine's scheduler whole: every flag named like a field of
``EngineConfig`` (a ``SchedulerConfig``) or ``PolicyConfig`` sets that field, and the engine
hands the config it is given to its scheduler, so a new scheduler setting is a field and a
flag of the same name (docs/architecture.md, "Worked example: a new scheduler setting")."""

from __future__ import annotations

import dataclasses

from pydantic import Field

from app.config import Settings
from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.policies import PolicyName
from app.engine.scheduler import BatchingPolicy
from app.models.mock import MockModel
from app.serving import engine_config
from app.serving.engine_config import named_like_settings


def test_every_scheduler_flag_reaches_the_engine_config() -> None:
    settings = Settings(
        num_slots=3, max_waiting=7, max_num_batched_tokens=40, max_prefill_chunk=5,
        block_size=4, kv_cache_tokens=64, max_model_len=50, enable_prefix_caching=True,
        batching="static", policy="mlfq", max_overtakes=9, preemption_threshold=2,
        preemption_delay=0.5, mlfq_levels=3, mlfq_quantum=8, mlfq_aging_seconds=1.5,
        mlfq_skip_join_tokens=64, fair_prompt_weight=0.5, fair_output_weight=3.0,
        fair_preemption=False, fair_preemption_margin=8.0, enable_lora=True, max_loras=2,
        max_cpu_loras=2, mock_jitter=0.1, seed=11,
    )  # fmt: skip
    config = engine_config(settings)
    assert (config.num_slots, config.max_waiting, config.max_num_batched_tokens) == (3, 7, 40)
    assert (config.max_prefill_chunk, config.block_size, config.kv_cache_tokens) == (5, 4, 64)
    assert (config.max_model_len, config.enable_prefix_caching) == (50, True)
    assert (config.batching, config.max_loras) == (BatchingPolicy.STATIC, 2)
    assert (config.step_jitter, config.seed, config.record_kv_events) == (0.1, 11, False)
    policy = config.policy
    assert policy.name is PolicyName.MLFQ
    assert (policy.max_overtakes, policy.preemption_threshold, policy.preemption_delay) == (
        9, 2, 0.5,
    )  # fmt: skip
    assert (policy.mlfq_levels, policy.mlfq_quantum, policy.mlfq_aging_seconds) == (3, 8, 1.5)
    assert (policy.mlfq_skip_join_tokens, policy.fair_prompt_weight) == (64, 0.5)
    assert (policy.fair_output_weight, policy.fair_preemption) == (3.0, False)
    assert policy.fair_preemption_margin == 8.0


def test_the_defaults_that_are_not_a_flag_of_the_same_name() -> None:
    config = engine_config(Settings(num_slots=4, max_model_len=100, block_size=16, max_loras=3))
    assert config.kv_cache_tokens == 4 * 7 * 16  # a whole context per slot, in whole blocks
    assert not config.kv_binds
    assert config.max_loras is None  # LoRA off without --enable-lora


def test_a_new_setting_needs_only_a_field_and_a_flag_of_the_same_name() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class WithNewSetting(EngineConfig):
        new_scheduler_knob: int = 1

    class NewSettings(Settings):
        new_scheduler_knob: int = Field(1, ge=1)

    named = named_like_settings(WithNewSetting, NewSettings(new_scheduler_knob=5))
    assert named["new_scheduler_knob"] == 5


def test_the_scheduler_gets_the_engine_config_whole() -> None:
    config = engine_config(Settings(model="mock", num_slots=2))
    engine = Engine(MockModel(), config)
    assert engine.core.scheduler.config is config
