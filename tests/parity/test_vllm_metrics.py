"""/metrics as vLLM 0.32 exports it (recorded in tests/parity/data/vllm_capture.json), with
the mock: every ``vllm:`` family of vLLM's with its type, labels (``engine="0"`` included) and
buckets, but those benchmarks/parity/accepted.py lists (tests/parity/test_vllm_parity.py checks
the rest of the answers with the real model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import ClientFactory

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from parity.compare import accepted_by, diff  # noqa: E402
from parity.normalise import metric_families  # noqa: E402

CAPTURE = ROOT / "tests" / "parity" / "data" / "vllm_capture.json"


async def test_metric_families_are_vllms(make_client: ClientFactory) -> None:
    vllm = metric_families(json.loads(CAPTURE.read_text())["answers"]["metrics"]["text"])
    async with make_client(model_name="anchor", max_model_len=2048) as client:
        reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert reply.status_code == 200
        ours = metric_families((await client.get("/metrics")).text)
    differences = diff("metrics", ".body", vllm, ours)
    assert [str(d) for d in differences if accepted_by(d) is None] == []
    assert ours["vllm:num_requests_running"]["engine"] == ["0"]
