"""``python -m app bench`` against real servers: its counts agree with the server's books, and
bad arguments or an unreachable server end in one line with exit status 2 or 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import free_port, running_server

from app.bench.cli import main

STEP_MS = 3.0


def bench(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", "bench", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def run_json(url: str, tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    done = bench("--url", url, "--json", str(out), *args)
    assert done.returncode == 0, done.stderr
    body: dict[str, Any] = json.loads(out.read_text())
    return body


@pytest.fixture(scope="module")
def server_url() -> Any:
    with running_server("--num-slots", "8", "--mock-step-ms", str(STEP_MS)) as server:
        yield server.url


def test_tokens_received_equal_the_servers_generated_tokens(
    server_url: str, tmp_path: Path
) -> None:
    body = run_json(server_url, tmp_path, "--num-requests", "40", "--concurrency", "12",
                    "--output-len", "uniform:1:30", "--warmup", "4", "--workers", "2")  # fmt: skip
    assert (body["completed"], body["cancelled"], body["failed"]) == (40, 0, 0)
    assert body["received_tokens"] == body["server_generation_tokens"]
    assert body["output_tokens"] == body["received_tokens"] > 0
    assert body["ttft_ms"]["p50"] >= STEP_MS  # no token before one model step
    assert set(body["tpot_ms"]) == {"mean", "p50", "p90", "p99"}
    assert len(body["tool_cpu_per_worker"]) == 2


def test_with_cancellations_every_request_is_accounted_for_and_none_is_overcounted(
    server_url: str, tmp_path: Path
) -> None:
    body = run_json(server_url, tmp_path, "--num-requests", "40", "--concurrency", "12",
                    "--output-len", "60", "--cancel-rate", "0.5", "--seed", "2")  # fmt: skip
    assert body["completed"] + body["cancelled"] + body["failed"] == 40
    assert body["cancelled"] > 0 and body["failed"] == 0
    # the server may generate a step or two past a cancel before it sees the disconnect
    assert body["received_tokens"] <= body["server_generation_tokens"]


def test_the_openai_api_is_measured_with_usage_counts(server_url: str, tmp_path: Path) -> None:
    body = run_json(server_url, tmp_path, "--api", "openai", "--num-requests", "10",
                    "--concurrency", "5", "--output-len", "12")  # fmt: skip
    assert body["completed"] == 10
    assert body["received_tokens"] == 120 == body["server_generation_tokens"]


def test_an_unreachable_server_is_one_line_and_exit_1() -> None:
    done = bench("--url", f"http://127.0.0.1:{free_port()}", "--num-requests", "1")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "cannot reach" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--num-requests", "0"], "--num-requests"),
        (["--output-len", "exp:5"], "exp:5"),
        (["--slo", "ttft=1"], "ttft=1"),
        (["--concurrency", "0"], "--concurrency"),
        (["--header", "novalue"], "--header"),
        (["--request-rate", "fast"], "--request-rate"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


def test_report_without_matplotlib_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(SystemExit) as exit_info:
        main(["--report", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'slotserve[bench]'" in err


def test_report_writes_the_charts(server_url: str, tmp_path: Path) -> None:
    done = bench("--url", server_url, "--num-requests", "8", "--output-len", "5",
                 "--report", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert {p.name for p in tmp_path.iterdir()} >= {"latency_cdf.png", "server_load.png"}


def test_a_protected_server_is_measured_with_the_key_from_the_environment(
    tmp_path: Path,
) -> None:
    with running_server("--api-key", "sesame", "--mock-step-ms", "1") as server:
        args = ("--url", server.url, "--num-requests", "3", "--output-len", "4")
        refused = bench(*args)
        assert refused.returncode == 1 and "HTTP 401" in refused.stdout
        out = tmp_path / "r.json"
        env = {**os.environ, "SLOTSERVE_API_KEY": "sesame"}
        allowed = subprocess.run([sys.executable, "-m", "app", "bench", "--no-progress", *args,
                                  "--json", str(out)], capture_output=True, text=True, env=env,
                                 timeout=60)  # fmt: skip
        assert allowed.returncode == 0, allowed.stderr
        body = json.loads(out.read_text())
        assert body["completed"] == 3 and body["server_samples"]  # /slots needs the key too
        assert "sesame" not in out.read_text()


def test_slotserve_bench_is_a_subcommand_of_the_main_cli(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from app.cli import main as slotserve

    with pytest.raises(SystemExit) as exit_info:
        slotserve(["bench", "--num-requests", "0"])
    assert exit_info.value.code == 2
    assert "slotserve bench: error: --num-requests" in capsys.readouterr().err


def finished_requests(url: str) -> float:
    """The server's ``vllm:request_success_total``, summed over its labels."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))  # fmt: skip


def running_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))  # fmt: skip


@pytest.mark.parametrize(
    ("workers", "sig", "group"),
    [
        ("1", signal.SIGINT, False),
        ("2", signal.SIGINT, False),
        ("2", signal.SIGTERM, False),
        ("1", signal.SIGINT, True),
        ("3", signal.SIGINT, True),  # a terminal's Ctrl-C: every process of the group
    ],
)
def test_an_interrupted_run_reports_the_requests_that_ended_as_partial(
    tmp_path: Path, workers: str, sig: signal.Signals, group: bool
) -> None:
    """Ctrl-C at a terminal (SIGINT to the whole process group), or a SIGINT or SIGTERM to the
    bench process alone (its workers included), ends the run early with its summary, JSON and
    charts for the requests done so far, marked partial, and the streams still open are closed
    (the server frees their slots)."""
    with running_server("--num-slots", "8", "--mock-step-ms", "2") as server:
        out, charts = tmp_path / "r.json", tmp_path / "charts"
        before = finished_requests(server.url)
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "bench", "--url", server.url, "--num-requests", "400",
             "--request-rate", "40", "--output-len", "40", "--workers", workers,
             "--slo", "ttft_ms=100", "--json", str(out), "--report", str(charts)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while finished_requests(server.url) - before < 10:  # the run is under way
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        if group:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=30)
        assert process.returncode == 130, stderr
        assert "partial" in stderr and "Traceback" not in stderr
        assert "slotserve bench (partial)" in stdout
        body = json.loads(out.read_text())
        assert body["partial"] is True and body["planned_requests"] == 400
        assert 10 <= body["completed"] == body["requests"] < 400
        assert {p.name for p in charts.iterdir()} >= {"latency_cdf.png", "server_load.png"}
        deadline = time.monotonic() + 10
        while running_requests(server.url) > 0:  # the open streams were closed and aborted
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_without_a_terminal_progress_is_a_line_every_few_seconds(
    server_url: str,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, app.bench.cli as c; c.PROGRESS_LINE_S = 0.0; "
         "sys.exit(c.main(sys.argv[1:]))", "--url", server_url, "--num-requests", "3",
         "--output-len", "2", "--concurrency", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "requests ended" in line]
    assert lines[-1].startswith("slotserve bench: 3/3 requests ended, 0 failed")


def test_help_shows_each_default_once_and_never_the_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOTSERVE_API_KEY", "hunter2")
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "hunter2" not in text and "(default: None)" not in text
    assert "(default: 200)" in text  # --num-requests
