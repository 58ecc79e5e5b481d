"""Issue 28, online: the real inference-perf against `serve --model-config`, beside `simulate`.

For each chosen shared experiment (../shared/fidelity/vllm-h100-measured.json) whose stages
are not overloaded: its inference-perf config with every stage shortened to `--stage-seconds`,
run by the real inference-perf (PyPI; it needs Python >= 3.12, so it lives in a venv of its
own: `--inference-perf PATH`) against `python -m app serve` with the experiment's model config,
GPU, tensor-parallel size and vLLM limits, and `--tokenizer DIR` (a local Hugging Face
tokenizer that both inference-perf and the server count tokens in; nothing is fetched). The
same config then goes through `python -m app simulate` with an exact client (one timestamp per
token, as inference-perf counts since v0.6.0). Both write inference-perf's report files; the
table gives each stage's mean TTFT, TPOT and E2E online, simulated and measured on the H100, and
the online-vs-simulated difference in percentage points of the measured value.

Run: PYTHONPATH=. flock /tmp/bench.lock python benchmarks/fidelity_inference_perf.py \
         --inference-perf /tmp/ipvenv/bin/inference-perf --tokenizer DIR \
         [--experiments general,codegen] [--stage-seconds 120] [--output DIR]
Only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _serve import slotserve

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "fidelity"
METRICS = (("TTFT ms", "time_to_first_token", "ttft_s", 1000), ("TPOT ms", "time_per_output_token", "tpot_s", 1000),
           ("E2E s", "request_latency", "e2e_s", 1))  # fmt: skip


def experiments(names: list[str]) -> list[dict[str, Any]]:
    data = json.loads((SHARED / "vllm-h100-measured.json").read_text())
    return [e for e in data["experiments"] for name in names if e["experiment"].endswith(name)]


def model_config(experiment: dict[str, Any]) -> Path:
    name = experiment["model"].split("/")[-1]
    return SHARED / "configs" / f"{name}.json"


def shortened(experiment: dict[str, Any], seconds: float) -> dict[str, Any]:
    config: dict[str, Any] = copy.deepcopy(experiment["inference_perf_config"])
    for stage in config["load"]["stages"]:
        stage["duration"] = min(stage["duration"], seconds)
    return config


def serve_flags(experiment: dict[str, Any], tokenizer: Path) -> list[str]:
    limits = experiment["vllm"]
    return ["--model-config", str(model_config(experiment)), "--gpu", "h100-sxm",
            "--tensor-parallel-size", str(experiment["tensor_parallel"]),
            "--max-num-seqs", str(limits["max_num_seqs"]),
            "--max-num-batched-tokens", str(limits["max_num_batched_tokens"]),
            "--max-model-len", str(limits["max_model_len"]), "--tokenizer", str(tokenizer)]  # fmt: skip


def run_online(experiment: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    with slotserve(*serve_flags(experiment, args.tokenizer)) as url:
        config = shortened(experiment, args.stage_seconds)
        config["server"] = {"type": "vllm", "base_url": url, "ignore_eos": True}
        config["tokenizer"] = {"pretrained_model_name_or_path": str(args.tokenizer)}
        config["storage"] = {"local_storage": {"path": str(out)}}
        path = out.parent / f"{out.name}.yaml"
        path.write_text(yaml.safe_dump(config))
        subprocess.run([str(args.inference_perf), "-c", str(path)], check=True, cwd=out.parent,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip


def run_simulated(experiment: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(shortened(experiment, args.stage_seconds)))
    limits = experiment["vllm"]
    subprocess.run([sys.executable, "-m", "app", "simulate", "--inference-perf-config", str(path),
                    "--model-config", str(model_config(experiment)), "--gpu", "h100-sxm",
                    "--tensor-parallel-size", str(experiment["tensor_parallel"]),
                    "--max-num-seqs", str(limits["max_num_seqs"]),
                    "--max-num-batched-tokens", str(limits["max_num_batched_tokens"]),
                    "--max-model-len", str(limits["max_model_len"]),
                    "--client-timestamps-per-token", "1", "--output", str(out)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip


def stage_files(directory: Path) -> list[dict[str, Any]]:
    files = sorted(
        directory.rglob("stage_*_lifecycle_metrics.json"), key=lambda p: int(p.name.split("_")[1])
    )
    return [json.loads(p.read_text()) for p in files]


def mean(report: dict[str, Any], key: str) -> float:
    return float(report["successes"]["latency"][key]["mean"])


def compare(experiment: dict[str, Any], online: Path, simulated: Path) -> list[dict[str, Any]]:
    rows = []
    for index, (on, sim, measured) in enumerate(zip(stage_files(online), stage_files(simulated),
                                                     experiment["stages"], strict=True)):  # fmt: skip
        row: dict[str, Any] = {"experiment": experiment["experiment"], "stage": index,
                               "rate": measured["rate"], "requests": on["successes"]["count"]}  # fmt: skip
        for label, key, truth, scale in METRICS:
            real = measured["measured"][truth]["mean"]
            o, s = mean(on, key), mean(sim, key)
            row[label] = {"online": o * scale, "simulated": s * scale, "measured": real * scale,
                          "online_minus_simulated_pp": 100 * (o - s) / real}  # fmt: skip
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inference-perf", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--experiments", default="general,codegen")
    parser.add_argument("--stage-seconds", type=float, default=120.0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    out = args.output or Path(tempfile.mkdtemp(prefix="fidelity-ip-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for experiment in experiments(args.experiments.split(",")):
        name = experiment["experiment"]
        online, simulated = out / f"{name}-online", out / f"{name}-simulated"
        run_online(experiment, args, online)
        run_simulated(experiment, args, simulated)
        rows += compare(experiment, online, simulated)
    (out / "comparison.json").write_text(json.dumps(rows, indent=1))
    print(f"{'experiment':44} st rate  n   " + "  ".join(f"{m[0]:>30}" for m in METRICS))
    print(" " * 62 + "  ".join(f"{'online/sim/measured (pp)':>30}" for _ in METRICS))
    for row in rows:
        cells = []
        for label, *_ in METRICS:
            c = row[label]
            cells.append(
                f"{c['online']:8.2f}/{c['simulated']:7.2f}/{c['measured']:7.2f} ({c['online_minus_simulated_pp']:+5.1f})"
            )
        print(
            f"{row['experiment']:44} {row['stage']:2} {row['rate']:4g} {row['requests']:4}  "
            + "  ".join(cells)
        )
    print(f"reports and comparison.json in {out}")


if __name__ == "__main__":
    main()
