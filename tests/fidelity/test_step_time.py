"""The physics step time (app/step_time): hand-computed terms, MoE, tensor parallelism, KV
capacity, and the errors a bad --model-config / --gpu / --tensor-parallel-size gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.engine.step_clock import StepWork
from app.step_time.gpus import GPUS, Gpu, UnknownGpuError, gpu
from app.step_time.model_config import ModelConfigError, load_model_config, shape_from_config
from app.step_time.physics import Calibration, PhysicsStepTime, kv_cache_tokens

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "torch_dtype": "bfloat16",
}
MOE = TINY | {"num_local_experts": 8, "num_experts_per_tok": 2}
# 1 TFLOP/s, 1 TB/s, 1 GB, 1 GB/s links: terms are easy to compute by hand
UNIT = Gpu("unit", 1.0, 0.0, 1.0, 1.0, 1.0)
RAW = Calibration()  # every correction 1, no overheads: the bare roofline


def test_shape_counts_parameters_and_kv_bytes() -> None:
    m = shape_from_config(TINY)
    assert m.head_dim == 16
    # q and o: 64 x 64 each; k and v: 64 x (2 x 16) each; MLP: 3 x 64 x 128
    assert m.attention_params == 2 * 64 * 64 + 2 * 64 * 32
    assert m.layer_params == m.attention_params + 3 * 64 * 128
    assert m.params == 2 * m.layer_params + 2 * 100 * 64  # untied embeddings and LM head
    assert m.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 heads, bf16
    assert m.kv_bytes_per_token(2) == m.kv_bytes_per_token() // 2
    assert m.kv_bytes_per_token(4) == m.kv_bytes_per_token(2)  # a GPU holds >= 1 KV head


def test_a_decode_step_is_the_weights_plus_the_context_read() -> None:
    m = shape_from_config(TINY)
    physics = PhysicsStepTime(m, Gpu("fast", 1000.0, 0.0, 1.0, 1.0, 1.0), 1, RAW)
    work = StepWork((), (), (100, 50), 2)
    linear, attention, comm, layers, requests, one = physics.basis(work)
    weights = (2 * m.attention_params + 2 * 3 * 64 * 128 + 100 * 64) * 2  # LM head, no embedding
    assert linear == pytest.approx(weights / 1e12)  # memory-bound: 2 tokens of FLOPs are few
    assert attention == pytest.approx(150 * m.kv_bytes_per_token() / 1e12)
    assert (comm, layers, requests, one) == (0.0, 2.0, 2.0, 1.0)
    assert physics.seconds(work) == pytest.approx(linear + attention)


def test_a_prefill_chunk_pays_its_flops_and_attention_over_its_context() -> None:
    m = shape_from_config(TINY)
    physics = PhysicsStepTime(m, Gpu("slow", 1e-6, 0.0, 1e6, 1.0, 1.0), 1, RAW)  # compute-bound
    c, s = 32, 64  # a chunk of 32 tokens after 64 cached ones
    linear, attention, *_ = physics.basis(StepWork((c,), (s,), (), 1))
    flops = 2 * 2 * m.layer_params * c + 2 * 100 * 64  # linear layers, and one sampled LM row
    assert linear == pytest.approx(flops / 1e6)
    pairs = c * (s + (c + 1) / 2)  # causal: each query sees the cache and the chunk before it
    assert attention == pytest.approx(4 * 2 * 4 * 16 * pairs / 1e6)


def test_moe_reads_the_experts_the_tokens_reach() -> None:
    m = shape_from_config(MOE)
    assert m.moe and m.active_layer_params < m.layer_params
    physics = PhysicsStepTime(m, UNIT, 1, RAW)
    assert physics.experts_reached(1) == pytest.approx(2.0)
    assert physics.experts_reached(1000) == pytest.approx(8.0)
    one, many = physics.weight_bytes_read(1), physics.weight_bytes_read(1000)
    assert many - one == pytest.approx(2 * 6 * 3 * 64 * 128 * 2)  # 6 more experts, 2 layers
    dense = PhysicsStepTime(shape_from_config(TINY), UNIT, 1, RAW)
    assert dense.weight_bytes_read(1) == dense.weight_bytes_read(1000)


def test_tensor_parallel_splits_the_work_and_adds_all_reduces() -> None:
    m = shape_from_config(TINY)
    one, two = PhysicsStepTime(m, UNIT, 1, RAW), PhysicsStepTime(m, UNIT, 2, RAW)
    work = StepWork((), (), (100,) * 4, 4)
    b1, b2 = one.basis(work), two.basis(work)
    assert b2[0] == pytest.approx(b1[0] / 2)
    assert b2[1] == pytest.approx(b1[1] / 2)
    # two all-reduces per layer: 8 us each, plus a ring's 2 (P-1)/P of 4 tokens x 64 x 2 bytes
    assert b1[2] == 0.0
    assert b2[2] == pytest.approx(2 * 2 * (8e-6 + 1.0 * 4 * 64 * 2 / 1e9))


def test_kv_capacity_is_what_vllm_would_get() -> None:
    llama = shape_from_config(TINY | {"hidden_size": 4096, "num_hidden_layers": 32,
                                      "num_attention_heads": 32, "num_key_value_heads": 32,
                                      "intermediate_size": 11008, "vocab_size": 32000})  # fmt: skip
    tokens = kv_cache_tokens(llama, gpu("h100-sxm"), 1, 2048, 128)
    # 0.9 x 80 GiB - 13.5 GB of weights - the activation reserve, at 512 KiB per token
    assert 110_000 < tokens < 120_000
    assert kv_cache_tokens(llama, gpu("l40s"), 1, 2048, 128) < tokens * 0.55
    assert kv_cache_tokens(llama, Gpu("tiny", 1, 0, 1, 8, 1), 1, 2048, 128) == 0


def test_the_gpu_table_and_an_unknown_gpu() -> None:
    for name in ("h100-sxm", "h100-pcie", "h200", "a100-80gb", "l40s", "b200"):
        assert name in GPUS
    assert gpu("H100_SXM") is GPUS["h100-sxm"]
    with pytest.raises(UnknownGpuError, match=r"known: .*h100-sxm.*b200"):
        gpu("rtx-9090")


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"]
)
def test_a_missing_config_field_is_named(field: str, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in TINY.items() if k != field}))
    with pytest.raises(ModelConfigError, match=f"missing '{field}'"):
        load_model_config(path)


def test_a_moe_without_experts_per_token_and_bad_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        shape_from_config(TINY | {"num_local_experts": 8})
    with pytest.raises(ModelConfigError, match="cannot read"):
        load_model_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ModelConfigError, match="not JSON"):
        load_model_config(tmp_path / "bad.json")


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused() -> None:
    m = shape_from_config(TINY)
    with pytest.raises(ModelConfigError, match="does not divide the 4 attention heads"):
        PhysicsStepTime(m, UNIT, 3)
    PhysicsStepTime(m, UNIT, 4)  # 4 heads, 2 KV heads (replicated): allowed, as in vLLM


# --- serve --model-config -----------------------------------------------------------------


def _model_file(tmp_path: Path, config: dict[str, object]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_serve_model_config_presets_vllm_defaults_and_the_physics_clock(tmp_path: Path) -> None:
    from app.cli import parse
    from app.serving import engine_config

    path = _model_file(tmp_path, TINY | {"max_position_embeddings": 1024})
    _, s = parse(["serve", "--model-config", path, "--gpu", "a100-80gb",
                  "--tensor-parallel-size", "2", "--max-num-seqs", "64"])  # fmt: skip
    assert s.num_slots == 64  # vLLM's name for the slot count
    assert s.max_model_len == 1024 and s.enable_prefix_caching  # the model's, vLLM v1's
    shape = shape_from_config(TINY)
    expected = kv_cache_tokens(shape, gpu("a100-80gb"), 2, s.max_num_batched_tokens, 64)
    assert s.kv_cache_tokens == expected
    clock = engine_config(s).step_costs
    assert isinstance(clock, PhysicsStepTime) and clock.tp == 2
    work = StepWork((), (), (100,) * 8, 8)
    assert clock.seconds(work) == pytest.approx(
        PhysicsStepTime(shape, gpu("a100-80gb"), 2).seconds(work)
    )
    _, s = parse(["serve", "--model-config", path, "--max-model-len", "512",
                  "--no-enable-prefix-caching"])  # fmt: skip
    assert s.max_model_len == 512 and not s.enable_prefix_caching  # explicit flags win


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu", "rtx-9090"], "unknown GPU 'rtx-9090'; known: h100-sxm"),
        (["--tensor-parallel-size", "3"], "does not divide the 4 attention heads"),
        (["--profile", "llama3.1-8b-h100"], "--model-config and --profile"),
    ],
)
def test_serve_refuses_a_bad_gpu_or_tensor_parallel_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    from app.cli import parse

    with pytest.raises(SystemExit) as exit_:
        parse(["serve", "--model-config", _model_file(tmp_path, TINY), *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_known_model_name_stands_for_its_config() -> None:
    mixtral = load_model_config("mixtral-8x7b")
    assert mixtral.moe and mixtral.experts == 8 and mixtral.experts_per_token == 2
    assert 46e9 < mixtral.params < 47.5e9  # Mixtral 8x7B: 46.7 B parameters
    assert 8.0e9 < load_model_config("llama-3.1-8b").params < 8.1e9  # 8.03 B
    assert 6.7e9 < load_model_config("llama-2-7b").params < 6.8e9  # 6.74 B
    with pytest.raises(ModelConfigError, match="or one of: llama-2-7b"):
        load_model_config("llama-9")


def test_the_step_time_is_the_same_float_on_every_python() -> None:
    """The terms are added one by one in a fixed order, so a step's time is the same float
    under every Python (3.12's ``sum()`` of floats rounds differently: 1 ulp here)."""
    physics = PhysicsStepTime(shape_from_config(TINY), gpu("h100-sxm"), 1)
    contexts = [550, 1498, 400, 147, 557, 2028, 889, 1057, 2753, 1787, 2567, 1234, 1726, 2078]
    contexts += [1581, 2352, 1438, 2188, 2397, 1670, 2394, 952, 1380, 2794, 118, 1146, 2482]
    work = StepWork((202,), (591,), (*contexts, 2750, 2850), 1)
    assert physics.seconds(work).hex() == "0x1.e71516c20fe98p-10"
