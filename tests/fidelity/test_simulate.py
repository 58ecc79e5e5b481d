"""``slotserve simulate``: deterministic replays of inference-perf configs and traces on the
Scheduler and the physics step clock, inference-perf's report files, and the errors of bad
input (each names what is wrong)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.cli import main as cli_main
from app.engine.scheduler import SchedulerConfig
from app.engine.step_clock import StepClock, StepCosts
from app.simulate.cli import main
from app.simulate.report import EXACT_CLIENT, MEASURED_CLIENT, reports
from app.simulate.run import Overheads, simulate
from app.simulate.workload import WorkloadError, from_inference_perf, load_trace

LLAMA = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 1024,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}
CONFIG = {
    "data": {
        "type": "shared_prefix",
        "shared_prefix": {
            "num_groups": 2,
            "num_prompts_per_group": 3,
            "system_prompt_len": 40,
            "question_len": 60,
            "output_len": 20,
        },
    },
    "load": {
        "type": "constant",
        "stages": [{"rate": 4, "duration": 5}, {"rate": 8, "duration": 5}],
    },
}
KEYS = ("time_to_first_token", "time_per_output_token", "request_latency",
        "inter_token_latency", "normalized_time_per_output_token")  # fmt: skip
STATS = ("mean", "min", "p0.1", "p1", "p5", "p10", "p25", "median", "p75", "p90", "p95", "p99",
         "p99.9", "max")  # fmt: skip


def _files(tmp_path: Path, config: dict[str, Any] = CONFIG) -> tuple[Path, Path]:
    model, ipc = tmp_path / "config.json", tmp_path / "ip.json"
    model.write_text(json.dumps(LLAMA))
    ipc.write_text(json.dumps(config))
    return model, ipc


def _run(tmp_path: Path, *extra: str, config: dict[str, Any] = CONFIG) -> int:
    model, ipc = _files(tmp_path, config)
    return main(["--inference-perf-config", str(ipc), "--model-config", str(model),
                 "--gpu", "h100-sxm", "--tensor-parallel-size", "2", "--max-num-seqs", "16",
                 "--max-num-batched-tokens", "256", "--max-model-len", "1024", *extra])  # fmt: skip


def test_simulate_writes_inference_perf_reports_deterministically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out1, out2 = tmp_path / "a", tmp_path / "b"
    assert _run(tmp_path, "--output", str(out1)) == 0
    assert _run(tmp_path, "--output", str(out2)) == 0
    names = sorted(p.name for p in out1.iterdir())
    assert names == ["stage_0_lifecycle_metrics.json", "stage_1_lifecycle_metrics.json",
                     "summary_lifecycle_metrics.json"]  # fmt: skip
    for name in names:
        assert (out1 / name).read_text() == (out2 / name).read_text()  # same seed, same bytes
    stage = json.loads((out1 / names[0]).read_text())
    assert stage["load_summary"]["count"] == 20 and stage["load_summary"]["requested_rate"] == 4
    ok = stage["successes"]
    assert ok["count"] == 20 and stage["failures"]["count"] == 0
    for key in KEYS:
        assert tuple(ok["latency"][key]) == STATS
    assert ok["output_len"]["mean"] == 20 and ok["prompt_len"]["mean"] == 100
    assert set(ok["throughput"]) >= {"output_tokens_per_sec", "requests_per_sec"}
    table = capsys.readouterr().out
    assert "TTFT ms" in table and "simulated" in table
    assert _run(tmp_path, "--output", str(tmp_path / "c"), "--seed", "1") == 0
    other = json.loads((tmp_path / "c" / names[0]).read_text())
    assert other != stage  # another seed, other arrivals


def test_the_cli_dispatches_simulate(tmp_path: Path) -> None:
    model, ipc = _files(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["simulate", "--inference-perf-config", str(ipc), "--model-config", str(model),
                  "--max-num-seqs", "16"])  # fmt: skip
    assert exit_.value.code == 0


@pytest.mark.parametrize(
    ("flags", "config", "message"),
    [
        (["--gpu", "rtx-9090"], CONFIG, "unknown GPU 'rtx-9090'; known: h100-sxm"),
        (["--tensor-parallel-size", "3"], CONFIG, "does not divide the 8 attention heads"),
        ([], CONFIG | {"data": {"type": "sharegpt"}}, "data.type 'sharegpt' is not supported"),
        ([], CONFIG | {"load": {"type": "sweep", "stages": []}}, "load.type 'sweep'"),
    ],
)
def test_bad_input_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
    config: dict[str, Any], message: str,
) -> None:  # fmt: skip
    model, ipc = _files(tmp_path, config)
    args = ["--inference-perf-config", str(ipc), "--model-config", str(model), *flags]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_config_missing_a_field_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, ipc = _files(tmp_path)
    model.write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}))
    with pytest.raises(SystemExit):
        main(["--inference-perf-config", str(ipc), "--model-config", str(model)])
    assert "missing 'num_hidden_layers'" in capsys.readouterr().err


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival": 0, "prompt_len": 10, "output_len": 3}\n\n{"arrival": 1}\n')
    with pytest.raises(WorkloadError, match=r"t.jsonl:3: .*missing 'output_len'"):
        load_trace(trace, 100)
    trace.write_text('{"arrival": 0, "prompt_len": 10, "output_len": 3}\nnot json\n')
    with pytest.raises(WorkloadError, match=r"t.jsonl:2: not a trace request"):
        load_trace(trace, 100)


def test_a_trace_replays_with_its_prefix_groups(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [{"arrival": i * 0.5, "prompt_len": 64, "output_len": 4, "prefix_group": "sys",
              "prefix_len": 48} for i in range(4)]  # fmt: skip
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    workload = load_trace(trace, 1000)
    prompts = [r.prompt for r in workload.stages[0].requests]
    assert all(p[:48] == prompts[0][:48] for p in prompts) and len({tuple(p) for p in prompts}) == 4
    config = SchedulerConfig(4, max_num_batched_tokens=64, enable_prefix_caching=True)
    clock = StepClock(StepCosts(step_ms=10.0, prefill_token_ms=1.0))
    (run,) = simulate(workload, config, clock, Overheads(late_admission=False))
    first, later = run.records[0], run.records[1]
    assert first.first_token is not None and later.first_token is not None
    # the first prefills 64 tokens (74 ms); the others find 48 cached and prefill 16 (26 ms)
    assert first.first_token - first.sent == pytest.approx(0.074)
    assert later.first_token - later.sent == pytest.approx(0.026)


def test_the_client_model_counts_tpot_as_the_measured_inference_perf() -> None:
    config = {"data": {"type": "random",
                       "input_distribution": {"min": 32, "max": 32, "mean": 32, "total_count": 1},
                       "output_distribution": {"min": 11, "max": 11, "mean": 11, "total_count": 1}},
              "load": {"type": "poisson", "stages": [{"rate": 0.2, "duration": 10}]}}  # fmt: skip
    workload = from_inference_perf(config, 1000, seed=3)
    sched = SchedulerConfig(4, max_num_batched_tokens=64)
    runs = simulate(workload, sched, StepClock(StepCosts(step_ms=10.0)), Overheads())
    assert runs[0].records, "the poisson stage sent nothing"
    exact = reports(runs, EXACT_CLIENT)["stage_0_lifecycle_metrics.json"]
    measured = reports(runs, MEASURED_CLIENT)["stage_0_lifecycle_metrics.json"]
    tpot = exact["successes"]["latency"]["time_per_output_token"]["mean"]
    assert tpot == pytest.approx(0.010)  # lone requests: one 10 ms step per token
    # two stamps per token and two at the end: 10 gaps of 10 ms over 2 x 11 + 2 - 1 intervals
    assert measured["successes"]["latency"]["time_per_output_token"]["mean"] == pytest.approx(
        0.100 / 23
    )
    assert measured["successes"]["latency"]["inter_token_latency"]["median"] == 0.0


def test_late_admission_costs_a_step_while_the_engine_is_busy() -> None:
    config = {"data": {"type": "random",
                       "input_distribution": {"min": 16, "max": 16, "mean": 16, "total_count": 1},
                       "output_distribution": {"min": 400, "max": 400, "mean": 400,
                                               "total_count": 1}},
              "load": {"type": "constant", "stages": [{"rate": 2, "duration": 3}]}}  # fmt: skip
    sched = SchedulerConfig(8, max_num_batched_tokens=64)
    ttft: dict[bool, list[float]] = {}
    for late in (False, True):
        workload = from_inference_perf(config, 1000, seed=1)
        clock = StepClock(StepCosts(step_ms=10.0))  # every step 10 ms: the same boundaries
        (run,) = simulate(workload, sched, clock, Overheads(late_admission=late))
        ttft[late] = [r.first_token - r.sent for r in run.records if r.first_token is not None]
    assert ttft[True][0] == pytest.approx(ttft[False][0])  # the engine was idle: no wait
    for early, later in zip(ttft[False][1:], ttft[True][1:], strict=True):
        assert later - early == pytest.approx(0.010)  # busy: one more step
