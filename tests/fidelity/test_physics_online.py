"""``serve --model-config`` paces tokens as ``simulate`` predicts for the same request (issue 28):
a real server process, one streamed request, its time per output token against the
simulation's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from server_process import running_server

from app.simulate.cli import main as simulate_main

LLAMA_7B = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
    "max_position_embeddings": 4096, "torch_dtype": "float16",
}  # fmt: skip
TOKENS = 40


def test_online_tpot_matches_simulate(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_7B))
    flags = ["--model-config", str(config), "--gpu", "l40s", "--max-num-seqs", "8",
             "--max-num-batched-tokens", "2048"]  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"arrival": 0, "prompt_len": 20, "output_len": TOKENS}) + "\n")
    out = tmp_path / "sim"
    assert simulate_main(["--trace", str(trace), *flags, "--output", str(out),
                          "--client-timestamps-per-token", "1"]) == 0  # fmt: skip
    report = json.loads((out / "stage_0_lifecycle_metrics.json").read_text())
    simulated = report["successes"]["latency"]["time_per_output_token"]["mean"]
    simulated_ttft = report["successes"]["latency"]["time_to_first_token"]["mean"]
    assert 0.015 < simulated < 0.025  # ~13.5 GB of weights at 0.864 TB/s, and the overheads
    with running_server(*flags) as server, httpx.Client(base_url=server.url) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Tell me a story about", "max_tokens": TOKENS,
                "stream": True, "ignore_eos": True}  # fmt: skip
        warm = body | {"max_tokens": 2, "stream": False}
        assert client.post("/v1/completions", json=warm, timeout=30).status_code == 200
        times: list[float] = []
        sent = time.perf_counter()
        with client.stream("POST", "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
    assert len(times) >= TOKENS
    online = (times[TOKENS - 1] - times[0]) / (TOKENS - 1)
    assert online == pytest.approx(simulated, rel=0.10)
    # the API time the fit found (6.9 ms) and one prefill step, plus this server's own HTTP work
    # (a few ms; tens on a loaded machine)
    assert simulated_ttft - 0.002 <= times[0] - sent <= simulated_ttft + 0.05
