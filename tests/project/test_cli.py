"""The command line: every setting is a flag and a SLOTSERVE_* variable, and bad values are
refused with a usage error naming both, not a traceback."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import httpx
import pytest
from server_process import running_server

from app.cli import parse
from app.config import Settings


def test_every_setting_has_a_flag_and_a_variable_shown_in_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in text
        assert f"SLOTSERVE_{name.upper()}" in text


def test_defaults_serve_the_mock_on_localhost_8000_with_a_long_context() -> None:
    command, settings = parse(["serve"])
    assert command == "serve"
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert settings.max_model_len >= 8192


def test_a_flag_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_NUM_SLOTS", "16")
    monkeypatch.setenv("SLOTSERVE_BATCHING", "static")
    _, settings = parse(["serve", "--num-slots", "4"])
    assert settings.num_slots == 4 and settings.batching == "static"


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["serve", "--num-slots", "0"], {}, "--num-slots (SLOTSERVE_NUM_SLOTS)"),
        (["serve"], {"SLOTSERVE_NUM_SLOTS": "abc"}, "--num-slots (SLOTSERVE_NUM_SLOTS)"),
        (["serve", "--port", "70000"], {}, "--port (SLOTSERVE_PORT)"),
        (["serve", "--batching", "eager"], {}, "--batching"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_the_docs_document_every_flag() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    text = "".join(page.read_text() for page in docs.glob("*.md"))
    missing = [n for n in Settings.model_fields if f"`--{n.replace('_', '-')}`" not in text]
    assert missing == []


def test_version_is_the_installed_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"slotserve {importlib.metadata.version('slotserve')}"


def test_probe_requests_are_logged_at_debug_and_others_at_info(tmp_path: Path) -> None:
    """Health checks and scrapes come every few seconds: at INFO they would drown the log."""
    log = tmp_path / "server.log"
    with log.open("wb") as sink, running_server("--log-level", "info", stderr=sink) as server:
        httpx.get(f"{server.url}/health")
        httpx.get(f"{server.url}/metrics")
        httpx.get(f"{server.url}/v1/models")
    text = log.read_text()
    assert '"GET /v1/models HTTP/1.1" 200' in text
    assert "GET /health" not in text and "GET /metrics" not in text
    with log.open("wb") as sink, running_server("--log-level", "debug", stderr=sink) as server:
        httpx.get(f"{server.url}/metrics")
    assert "GET /metrics" in log.read_text()
