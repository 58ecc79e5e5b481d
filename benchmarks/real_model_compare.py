"""slotserve vs vLLM's CPU build vs llama-server on SmolLM2-135M-Instruct, one server after
another, each driven by `slotserve bench --api openai` (POST /v1/completions, streamed, eos
ignored) with the same workloads:

  greedy   64 requests, 32 in flight, 32-token prompts, 64 new tokens, temperature 0
  sampled  the same at temperature 1
  single   4 requests one at a time, 128 new tokens, temperature 0
  drawn    96 requests, 32 in flight, output lengths exp:64:256 (capped exponential), temp 0
  sampled48  96 requests, 48 in flight, output lengths exp:64:256, temperature 1 (every server
           keeps its 32 slots: 16 requests wait in its queue)

Servers (each skipped when its command is missing), each started once, its start-up time (start
to the first /health 200) printed:
  slotserve  `python -m app serve --model smollm2 --num-slots 32` + SLOTSERVE_FLAGS (default flags)
  slotserve-int4  the same + `--quantization int4`
  vllm       ../shared/bench/vllm_cpu_anchor.sh serve FOLDER (bf16, 32 sequences), FOLDER being
             the HF folder slotserve converts SmolLM2 to
  llama      ../shared/bench/llama_server_anchor.sh serve GGUF (the package's Q4_1, -np 32 -t 2)

Run alone (exclusive bench lock):
  python benchmarks/real_model_compare.py [--servers slotserve,vllm,llama] [--workloads ...]
  [--slotserve-flags "--compile auto"] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _serve import ROOT, bench, engine_commit, free_port, started

# the anchors' scripts: ../shared/bench next to this checkout unless SLOTSERVE_ANCHORS names them
ANCHORS = Path(os.environ.get("SLOTSERVE_ANCHORS", ROOT.parent / "shared" / "bench"))
COMMON = ["--api", "openai", "--prompt-len", "32", "--monitor", "off"]
WORKLOADS: dict[str, list[str]] = {
    "greedy": ["--num-requests", "64", "--concurrency", "32", "--output-len", "64",
               "--temperature", "0"],
    "sampled": ["--num-requests", "64", "--concurrency", "32", "--output-len", "64",
                "--temperature", "1"],
    "single": ["--num-requests", "4", "--concurrency", "1", "--output-len", "128",
               "--temperature", "0"],
    "drawn": ["--num-requests", "96", "--concurrency", "32", "--output-len", "exp:64:256",
              "--temperature", "0"],
    "sampled48": ["--num-requests", "96", "--concurrency", "48", "--output-len", "exp:64:256",
                  "--temperature", "1"],
}  # fmt: skip
WARMUP = ["--warmup", "4"]


def commands(name: str, port: int, slotserve_flags: list[str]) -> tuple[list[str], str] | None:
    """The server command and the model name to send, or None when it is not installed."""
    from app.models.hf.weights import default_cache_dir, smollm2_folder, smollm2_gguf

    if name in ("slotserve", "slotserve-int4"):
        quantization = ["--quantization", "int4"] if name == "slotserve-int4" else []
        return [sys.executable, "-m", "app", "serve", "--model", "smollm2", "--num-slots", "32",
                "--port", str(port), "--log-level", "warning", *slotserve_flags,
                *quantization], "SmolLM2-135M-Instruct"  # fmt: skip
    if name == "vllm":
        if not Path(os.environ.get("VLLM_VENV", "/tmp/vllm-cpu-venv"), "bin", "vllm").exists():
            return None
        folder = smollm2_folder(default_cache_dir())
        return ["bash", str(ANCHORS / "vllm_cpu_anchor.sh"), "serve", str(folder),
                str(port)], "anchor"  # fmt: skip
    if name == "llama":
        if not Path(os.environ.get("LLAMA_DIR", "/tmp/llama-cpp"), "llama-server").exists():
            return None
        return ["bash", str(ANCHORS / "llama_server_anchor.sh"), "serve", str(smollm2_gguf()),
                str(port)], "anchor"  # fmt: skip
    raise SystemExit(f"unknown server {name!r}")


def version(name: str) -> str:
    """What the server is: slotserve's commit, vLLM's package version, llama-server's build."""
    if name.startswith("slotserve"):
        return engine_commit()
    if name == "vllm":
        python = Path(os.environ.get("VLLM_VENV", "/tmp/vllm-cpu-venv"), "bin", "python")
        query = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
        command = [str(python), "-c", query]
    else:
        command = [str(Path(os.environ.get("LLAMA_DIR", "/tmp/llama-cpp"), "llama-server")),
                   "--version"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    named = [line for line in lines if name == "vllm" or line.startswith("version")]
    return named[-1] if named else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="slotserve,vllm,llama")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--slotserve-flags", default="")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    flags = shlex.split(args.slotserve_flags)
    print(f"commit {engine_commit()}, slotserve flags {flags or '(defaults)'}", flush=True)
    table: dict[str, dict[str, Any]] = {}
    for server in args.servers.split(","):
        port = free_port()
        found = commands(server, port, flags)
        if found is None:
            print(f"{server}: not installed, skipped", flush=True)
            continue
        command, model = found
        load = os.getloadavg()[0]
        began = time.monotonic()
        with started(command, port, timeout=900) as url:
            startup = time.monotonic() - began
            what = version(server)
            table.setdefault(server, {})["startup"] = {"seconds": round(startup, 1),
                                                       "load_before": round(load, 2),
                                                       "version": what}  # fmt: skip
            print(f"{server:9s} {what}: healthy {startup:.1f} s after start, load "
                  f"average before {load:.2f}", flush=True)  # fmt: skip
            for workload in args.workloads.split(","):
                load = os.getloadavg()[0]
                out = bench(url, *COMMON, "--model", model, *WARMUP, *WORKLOADS[workload])
                row = {
                    "tokens_per_s": out["output_throughput"],
                    "tpot_p50_ms": out["tpot_ms"]["p50"] or 0.0,
                    "ttft_p50_ms": out["ttft_ms"]["p50"] or 0.0,
                    "failed": out["failed"],
                    "load_before": round(load, 2),
                }
                table.setdefault(server, {})[workload] = row
                print(f"{server:9s} {workload:8s} {row['tokens_per_s']:8.1f} tokens/s, TPOT p50 "
                      f"{row['tpot_p50_ms']:.1f} ms, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                      f"failed {row['failed']}, load average before {load:.2f}",
                      flush=True)  # fmt: skip
                if args.json:  # after every figure: a later server's failure keeps the earlier
                    args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
