"""Serving real models end to end: real ``python -m app serve`` processes on 127.0.0.1 with a
tiny local checkpoint (``hf:PATH``) and with SmolLM2 itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hf_smollm2 import smollm2_cache_dir
from hf_tiny import save_tiny_model, save_tokenizer
from server_process import loading_server
from sse import parse_sse


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-serving")
    save_tokenizer(folder)
    return save_tiny_model(folder)


def test_health_says_loading_until_the_model_is_ready_then_it_serves(tiny: Path) -> None:
    # 512 bytes of KV cache per token (2 layers x K and V x 2 heads x 16 x 4 bytes): 96 KiB
    # hold 192 tokens, 64 positions for each of 3 slots.
    flags = ["--model", f"hf:{tiny}", "--num-slots", "3", "--kv-cache-memory", "96KiB"]
    flags += ["--dtype", "float32"]  # auto would pick bfloat16 on a CPU with native bf16
    with loading_server(*flags) as (server, seen):
        assert seen == ["loading", "ok"]
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(tiny.name, 64)]
        long = {"prompt": [5] * 60, "max_tokens": 5, "stream": False}
        refused = httpx.post(server.url + "/generate", json=long, timeout=60)
        assert refused.headers["x-slotserve-error-code"] == "context_length_exceeded"
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] <= 5
        assert reply["model"] == tiny.name
        ids = {"prompt": [5, 6, 7], "max_tokens": 4, "stream": False, "ignore_eos": True}
        done = httpx.post(server.url + "/generate", json=ids, timeout=60).json()
        assert len(done["tokens"]) == 4
        too_big = {"prompt": [320], "max_tokens": 1, "stream": False}
        refused = httpx.post(server.url + "/generate", json=too_big, timeout=60)
        assert refused.status_code == 400
        assert refused.headers["x-slotserve-error-code"] == "invalid_token_id"


def test_a_model_that_fails_while_loading_leaves_health_at_load_failed(
    tiny: Path, tmp_path: Path
) -> None:
    """Found in review: a corrupt checkpoint answered ``loading`` with Retry-After (clients
    retried a permanent failure forever) and logged a traceback, not one line."""
    for file in tiny.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    log = tmp_path / "stderr.log"
    with (
        log.open("w") as stderr,
        loading_server("--model", f"hf:{tmp_path}", stderr=stderr) as (
            server,
            seen,
        ),
    ):
        assert seen[-1] == "load_failed"
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503
        refused = httpx.post(server.url + "/generate", json={"prompt": "x", "stream": False})
        assert refused.status_code == 503
        assert refused.headers["x-slotserve-error-code"] == "load_failed"
        assert "retry-after" not in refused.headers
        assert "failed to load" in refused.json()["error"]["message"]
    assert "Traceback" not in log.read_text()


def test_a_bad_model_path_exits_at_once_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "app", "serve", "--model", f"hf:{tmp_path / 'nope'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"slotserve: error: hf:{tmp_path / 'nope'}: no such directory"
    ]


QUESTION = "What is the capital of France?"


def test_smollm2_answers_paris_over_sse_and_through_the_openai_client() -> None:
    from openai import OpenAI

    flags = ["--model", "smollm2", "--model-cache-dir", str(smollm2_cache_dir())]
    flags += ["--num-slots", "2", "--max-model-len", "512"]
    with loading_server(*flags) as (server, seen):
        assert seen[-1] == "ok"
        chat = "<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
        body = {"prompt": chat, "max_tokens": 30, "temperature": 0}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as response:
            events = parse_sse(response.read().decode())
        tokens = [e for e in events if e.event == "token"]
        done = events[-1]
        assert done.event == "done"
        assert done.data["finish_reason"] == "stop"
        assert "".join(e.data["text"] for e in tokens) == done.data["text"]
        assert "Paris" in done.data["text"]

        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=30,
            temperature=0,
            stream=True,
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert "Paris" in text
