"""Bad input to ``simulate`` and ``serve --model-config`` (the review of issue 28): every
number of a trace, an inference-perf config or a config.json is checked (type, finite, range)
and a bad one is one line naming the line or field; workload sizes are bounded; flags that
would be ignored are refused; the KV cache, dtypes and client timeouts are priced as vLLM and
inference-perf do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_step_time import TINY as STEP_TINY

from app.engine.scheduler import SchedulerConfig
from app.engine.step_clock import StepClock, StepCosts
from app.simulate import workload as workload_module
from app.simulate.cli import main as simulate_main
from app.simulate.report import EXACT_CLIENT, reports
from app.simulate.run import Overheads, simulate
from app.simulate.workload import WorkloadError, from_inference_perf, load_trace
from app.step_time.model_config import ModelConfigError, shape_from_config

TINY = STEP_TINY | {"max_position_embeddings": 1024}
SHARED = {"num_groups": 2, "num_prompts_per_group": 2, "system_prompt_len": 8,
          "question_len": 8, "output_len": 4}  # fmt: skip


def _config(shared: dict[str, Any] | None = None, **load: Any) -> dict[str, Any]:
    return {
        "data": {"type": "shared_prefix", "shared_prefix": SHARED | (shared or {})},
        "load": {"type": "constant", "stages": [{"rate": 2, "duration": 2}]} | load,
    }


# --- traces ----------------------------------------------------------------------------------

GOOD_LINE = {"arrival": 0, "prompt_len": 10, "output_len": 5}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"arrival": NaN, "prompt_len": 10, "output_len": 5}', "arrival must be a finite"),
        ('{"arrival": Infinity, "prompt_len": 10, "output_len": 5}', "arrival must be a finite"),
        ('{"arrival": -1, "prompt_len": 10, "output_len": 5}', "arrival must be"),
        ('{"arrival": 0, "prompt_len": 10, "output_len": 0}', "output_len must be an integer >= 1"),
        ('{"arrival": 0, "prompt_len": 10, "output_len": 5.7}', "output_len must be an integer"),
        ('{"arrival": 0, "prompt_len": 3000000, "output_len": 5}', "prompt_len must be"),
        ('{"arrival": 0, "prompt_len": 10, "output_len": 5, "prefix_group": "a", '
         '"prefix_len": -3}', "prefix_len must be an integer >= 0"),
        ('{"arrival": 0, "prompt_len": 10, "output_len": 5, "prefix_group": {"x": 1}}',
         "prefix_group must be a string"),
    ],
)  # fmt: skip
def test_a_bad_trace_number_names_its_line_and_field(
    tmp_path: Path, line: str, message: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(GOOD_LINE) + "\n" + line + "\n")
    with pytest.raises(WorkloadError, match=rf"t\.jsonl:2: {message}"):
        load_trace(trace, 100, max_len=4096)


def test_a_trace_request_longer_than_max_model_len_is_refused_without_its_tokens(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "t.jsonl"
    long = {"arrival": 0, "prompt_len": 1_000_000, "output_len": 5}
    trace.write_text(json.dumps(GOOD_LINE) + "\n" + json.dumps(long) + "\n")
    workload = load_trace(trace, 100, max_len=4096)
    refused = [r for r in workload.stages[0].requests if r.refused_len]
    assert [(r.refused_len, r.prompt) for r in refused] == [(1_000_000, [])]
    (run,) = simulate(workload, SchedulerConfig(4, max_model_len=4096),
                      StepClock(StepCosts(step_ms=1.0)))  # fmt: skip
    failed = [r for r in run.records if r.failed]
    assert [(r.prompt_len, r.error) for r in failed] == [(1_000_000, "longer than --max-model-len")]


# --- inference-perf configs ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_config(stages=[{"rate": float("inf"), "duration": 5}]), r"stages\[0\]\.rate must be"),
        (_config(stages=[{"rate": float("nan"), "duration": 5}]), r"stages\[0\]\.rate must be"),
        (_config(interval=0), "load.interval must be a finite number > 0"),
        (_config(interval=-100), "load.interval must be a finite number > 0"),
        (_config(stages=[{"rate": 1, "duration": 3e6}], type="poisson"),
         r"stages\[0\]\.duration must be a finite number > 0 and <= 2592000"),
        (_config({"system_prompt_len": 3_000_000}), "system_prompt_len must be an integer"),
        (_config({"output_len": 0}), "output_len must be an integer >= 1"),
        ({"data": {"type": "random",
                   "input_distribution": {"min": 1, "max": 9, "mean": 5, "total_count": -1},
                   "output_distribution": {"min": 1, "max": 9, "mean": 5}},
          "load": {"stages": [{"rate": 1, "duration": 1}]}},
         "input_distribution.total_count must be an integer >= 1"),
    ],
)  # fmt: skip
def test_a_bad_inference_perf_number_is_named(config: dict[str, Any], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        from_inference_perf(config, 100)


def test_workload_sizes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workload_module, "MAX_REQUESTS", 100, raising=False)
    with pytest.raises(WorkloadError, match=r"stages\[1\]: .* more than 100 \(simulate's bound"):
        from_inference_perf(_config(stages=[{"rate": 10, "duration": 6},
                                            {"rate": 10, "duration": 6}]), 100)  # fmt: skip
    with pytest.raises(WorkloadError, match="num_groups must be an integer >= 1 and <= 100"):
        from_inference_perf(_config({"num_groups": 200}), 100)
    monkeypatch.setattr(workload_module, "MAX_WORKLOAD_TOKENS", 1000, raising=False)
    with pytest.raises(WorkloadError, match="prompts exceed 1000 tokens"):
        from_inference_perf(_config({"system_prompt_len": 300, "num_prompts_per_group": 3}), 100)


def test_a_prompt_longer_than_max_model_len_makes_no_tokens() -> None:
    workload = from_inference_perf(_config({"system_prompt_len": 1_000_000}), 100, max_len=4096)
    requests = workload.stages[0].requests
    assert requests and all(r.prompt == [] and r.refused_len == 1_000_008 for r in requests)


# --- config.json -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": -8}, "num_key_value_heads must be an integer >= 1"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be an integer >= 1"),
        ({"num_key_value_heads": 8}, "num_key_value_heads 8 must divide num_attention_heads 4"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 must divide"),
        ({"num_key_value_heads": 1.5}, "num_key_value_heads must be an integer"),
        ({"num_local_experts": -8, "num_experts_per_tok": 2}, "num_local_experts must be"),
        ({"num_local_experts": 8, "num_experts_per_tok": 10}, "num_experts_per_tok 10 exceeds"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1"),
        ({"max_position_embeddings": -1}, "max_position_embeddings must be an integer >= 1"),
        ({"max_position_embeddings": "4096"}, "max_position_embeddings must be an integer"),
        ({"head_dim": "x"}, "head_dim must be an integer"),
        ({"hidden_size": 2}, "hidden_size 2 is smaller than num_attention_heads 4"),
        ({"torch_dtype": ["bfloat16"]}, "torch_dtype must be a string"),
        ({"quantization_config": "fp8"}, "quantization_config must be an object"),
    ],
)
def test_a_bad_config_field_is_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        shape_from_config(TINY | change)


def test_the_kv_cache_and_float32_are_priced_as_vllm_serves_them() -> None:
    bf16 = shape_from_config(TINY)
    fp8 = shape_from_config(TINY | {"quantization_config": {"quant_method": "fp8"}})
    fp32 = shape_from_config(TINY | {"torch_dtype": "float32"})
    assert fp8.weight_bytes == bf16.weight_bytes // 2  # fp8 weights
    assert fp8.kv_bytes_per_token() == bf16.kv_bytes_per_token()  # kv_cache_dtype=auto: bf16
    assert fp32.weight_bytes == bf16.weight_bytes  # dtype=auto serves float32 in 16 bits
    assert fp32.kv_bytes_per_token() == bf16.kv_bytes_per_token()


# --- the CLIs: one line, exit status 2 -------------------------------------------------------


def _serve_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    from app.cli import parse

    with pytest.raises(SystemExit) as exit_:
        parse(["serve", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def _model_file(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_serve_refuses_a_model_that_leaves_no_kv_room(capsys: pytest.CaptureFixture[str]) -> None:
    err = _serve_error(capsys, "--model-config", "mixtral-8x7b", "--gpu", "h100-sxm")
    assert "no room for a KV cache: mixtral-8x7b's weights take 87.0 GiB on each of 1 x " in err
    assert "h100-sxm (80 GiB each" in err and "larger --tensor-parallel-size (now 1)" in err
    from app.cli import parse

    _, s = parse(["serve", "--model-config", "mixtral-8x7b", "--tensor-parallel-size", "2"])
    assert s.kv_cache_tokens is not None and s.kv_cache_tokens > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mock-step-ms", "5"], "--mock-step-ms: --model-config sets the step clock"),
        (["--mock-prefill-ms", "1", "--mock-per-seq-ms", "1"],
         "--mock-prefill-ms and --mock-per-seq-ms: --model-config"),
    ],
)  # fmt: skip
def test_serve_refuses_linear_clock_flags_beside_a_model_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert message in _serve_error(capsys, "--model-config", _model_file(tmp_path, TINY), *flags)


def test_serve_refuses_gpu_flags_without_a_model_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _serve_error(capsys, "--gpu", "a100-80gb", "--tensor-parallel-size", "2")
    assert "--gpu and --tensor-parallel-size apply only with --model-config" in err


@pytest.mark.parametrize(
    "change",
    [{"hidden_size": 16, "num_attention_heads": 32}, {"max_position_embeddings": "4096"}],
)
def test_a_bad_config_is_one_line_for_serve_and_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, Any]
) -> None:
    model = _model_file(tmp_path, TINY | change)
    field = next(iter(change)) if len(change) == 1 else "hidden_size 16"
    assert field in _serve_error(capsys, "--model-config", model)
    ipc = tmp_path / "ip.json"
    ipc.write_text(json.dumps(_config()))
    with pytest.raises(SystemExit) as exit_:
        simulate_main(["--inference-perf-config", str(ipc), "--model-config", model])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_simulate_refuses_gpu_flags_with_a_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ipc = tmp_path / "ip.json"
    ipc.write_text(json.dumps(_config()))
    with pytest.raises(SystemExit) as exit_:
        simulate_main(["--inference-perf-config", str(ipc), "--profile", "llama3.1-8b-h100",
                       "--gpu", "a100-80gb"])  # fmt: skip
    assert exit_.value.code == 2
    assert "--gpu applies only with --model-config" in capsys.readouterr().err


# --- client timeouts -------------------------------------------------------------------------


def test_a_client_timeout_records_the_timeout_as_its_latency(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"arrival": 0, "prompt_len": 16, "output_len": 1000}) + "\n")
    workload = load_trace(trace, 100)
    clock = StepClock(StepCosts(step_ms=10.0))  # 1000 tokens: 10 s, past the 2 s timeout
    runs = simulate(workload, SchedulerConfig(4), clock, Overheads(), timeout=2.0)
    failures = reports(runs, EXACT_CLIENT)["stage_0_lifecycle_metrics.json"]["failures"]
    assert failures["count"] == 1
    assert failures["request_latency"]["mean"] == pytest.approx(2.0)
