"""lm-evaluation-harness (PyPI ``lm-eval``) over slotserve: its ``local-completions`` model
against a real server running SmolLM2 answers a small local multiple-choice task exactly as
lm-eval's own ``hf`` backend does on the same checkpoint folder (the one slotserve converts
SmolLM2's GGUF into). Its loglikelihood requests are ``echo: true, max_tokens: 1, logprobs: 1``
completions whose prompt log probabilities it sums."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hf_smollm2 import smollm2_cache_dir
from server_process import loading_server

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "slotserve_mc"


def _task_folder(tmp_path: Path) -> Path:
    """The task's YAML with the absolute path of its items (lm-eval resolves data files from
    the working directory)."""
    yaml = (TASK_DIR / f"{TASK}.yaml").read_text()
    (tmp_path / f"{TASK}.yaml").write_text(
        yaml.replace("ITEMS_JSONL", str(TASK_DIR / "items.jsonl"))
    )
    return tmp_path


def _evaluate(
    model: str, model_args: dict[str, Any], tasks: Path, batch_size: int = 1
) -> list[dict[str, Any]]:
    import lm_eval  # type: ignore[import-untyped]
    from lm_eval.tasks import TaskManager  # type: ignore[import-untyped]

    result = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=batch_size,
    )
    assert result is not None
    samples: list[dict[str, Any]] = sorted(result["samples"][TASK], key=lambda s: s["doc_id"])
    return samples


def test_lm_eval_local_completions_answers_as_its_hf_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.models.hf.weights import smollm2_folder

    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(offline, "1")
    cache = smollm2_cache_dir()
    checkpoint = smollm2_folder(cache)
    tasks = _task_folder(tmp_path)
    flags = [
        "--model",
        "smollm2",
        "--model-cache-dir",
        str(cache),
        "--model-name",
        "smollm2",
        "--dtype",
        "float32",
    ]  # fmt: skip  (the hf backend's dtype below)
    with loading_server(*flags, "--num-slots", "4", "--max-model-len", "512") as (server, seen):
        assert seen[-1] == "ok"
        ours = _evaluate(
            "local-completions",
            {"base_url": server.url + "/v1/completions", "model": "smollm2",
             "tokenizer_backend": "huggingface", "tokenizer": str(checkpoint),
             "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1},
            tasks,
            batch_size=4,  # a list of 4 prompts per request (echo over several prompts)
        )  # fmt: skip
    hf = {"pretrained": str(checkpoint), "dtype": "float32", "device": "cpu"}
    theirs = _evaluate("hf", hf, tasks)
    assert len(ours) == len(theirs) == 20
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine["acc"] == reference["acc"], mine["doc"]
        for (ll, greedy), (want, want_greedy) in zip(
            mine["filtered_resps"], reference["filtered_resps"], strict=True
        ):
            assert ll == pytest.approx(want, abs=1e-3), mine["doc"]
            assert greedy == want_greedy, mine["doc"]
    accuracy = sum(s["acc"] for s in ours) / len(ours)
    assert accuracy >= 0.5  # a sanity floor: SmolLM2 knows most of these
