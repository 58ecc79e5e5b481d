"""``--profile``: GPU presets of the step clock and the limits, their KV arithmetic, flag
precedence, where the profile is named, and the KV capacity binding under a profile."""

from __future__ import annotations

import typing

import pytest
from conftest import ClientFactory
from prometheus_client.parser import text_string_to_metric_families
from reference import run_alone

from app.cli import parse
from app.config import Settings
from app.engine.runner import make_runner
from app.engine.scheduler import Scheduler
from app.engine.step_clock import StepWork
from app.engine.types import RequestStatus, Sequence
from app.models.cached_mock import CachedMockModel
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.profiles import PROFILE_NAMES, PROFILES, ProfileName
from app.serving import engine_config

H100 = "llama3.1-8b-h100"


def test_the_profile_names_are_the_presets() -> None:
    assert PROFILE_NAMES == tuple(PROFILES) == typing.get_args(ProfileName)


@pytest.mark.parametrize(
    ("name", "kv_bytes", "tokens"),
    [
        ("llama3.1-8b-h100", 128 * 1024, 426_784),
        ("llama3.1-8b-a100", 128 * 1024, 426_784),
        ("llama3.3-70b-h100-tp4", 320 * 1024, 448_280),
        ("qwen3-14b-h100", 160 * 1024, 259_175),
    ],
)
def test_kv_capacity_is_90_percent_of_gpu_memory_less_the_weights_per_kv_token(
    name: str, kv_bytes: int, tokens: int
) -> None:
    p = PROFILES[name]
    assert p.kv_bytes_per_token == kv_bytes
    assert p.kv_cache_tokens == int(0.9 * p.gpus * 80e9 - 2 * p.params) // kv_bytes == tokens
    # within 10% of the round figures (about 450,000 for Llama, 270,000 for Qwen)
    assert tokens == pytest.approx(270_000 if "qwen" in name else 450_000, rel=0.1)


def test_a_profile_sets_the_step_clock_and_the_limits() -> None:
    s = Settings(profile="llama3.1-8b-a100")
    assert (s.mock_step_ms, s.mock_prefill_ms, s.mock_per_seq_ms) == pytest.approx(
        (16.442, 0.0478, 0.0182)
    )
    assert (s.num_slots, s.max_model_len, s.max_num_batched_tokens) == (256, 8192, 8192)
    assert s.kv_cache_tokens == 426_784
    config = engine_config(s)
    assert config.step_costs.seconds(StepWork.counts(1024, 0)) == pytest.approx(
        (16442 + 47.8 * 1024) / 1e6
    )
    assert config.kv_binds  # 256 x 8192 tokens would need more


def test_flags_set_explicitly_win_over_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    # the suite's conftest sets it, and an env var counts as set
    monkeypatch.delenv("SLOTSERVE_COMPILE", raising=False)
    s = Settings(profile=H100, mock_step_ms=4.0, num_slots=64, kv_cache_tokens=100_000)
    assert (s.mock_step_ms, s.num_slots, s.kv_cache_tokens) == (4.0, 64, 100_000)
    assert (s.mock_prefill_ms, s.max_num_batched_tokens) == (0.0173, 8192)  # the rest: preset
    assert s.model_fields_set == {"profile", "mock_step_ms", "num_slots", "kv_cache_tokens"}


def test_a_flag_equal_to_the_default_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set explicitly means given, not different from the default: --mock-step-ms 0 keeps 0."""
    _, s = parse(["serve", "--profile", H100, "--mock-step-ms", "0", "--max-model-len", "8192"])
    assert (s.mock_step_ms, s.mock_per_seq_ms) == (0.0, 0.006)


def test_environment_variables_win_over_the_profile_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_PROFILE", "qwen3-14b-h100")
    monkeypatch.setenv("SLOTSERVE_MAX_NUM_BATCHED_TOKENS", "2048")
    _, s = parse(["serve", "--mock-per-seq-ms", "1.5"])
    assert (s.profile, s.max_num_batched_tokens, s.mock_per_seq_ms) == (
        "qwen3-14b-h100", 2048, 1.5,
    )  # fmt: skip
    assert (s.mock_step_ms, s.kv_cache_tokens) == (13.578, 259_175)


def test_an_unknown_profile_is_refused_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse(["serve", "--profile", "h200"])
    assert "llama3.1-8b-h100" in capsys.readouterr().err


def test_a_budget_below_the_profiles_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= --num-slots"):
        Settings(profile=H100, max_num_batched_tokens=128)


# --- named in /v1/models and /metrics ---------------------------------------------------------


def profile_info(text: str) -> dict[str, float]:
    return {
        sample.labels["profile"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "slotserve:profile_info"
    }


async def test_models_and_metrics_name_the_profile(make_client: ClientFactory) -> None:
    async with make_client(profile=H100, num_slots=8, max_num_batched_tokens=512) as client:
        model = (await client.get("/v1/models")).json()["data"][0]
        metrics = (await client.get("/metrics")).text
    assert (model["profile"], model["max_model_len"]) == (H100, 8192)
    assert profile_info(metrics) == {H100: 1.0}


async def test_without_a_profile_the_info_metric_says_none(make_client: ClientFactory) -> None:
    async with make_client() as client:
        assert (await client.get("/v1/models")).json()["data"][0]["profile"] is None
        assert profile_info((await client.get("/metrics")).text) == {"none": 1.0}


# --- the KV capacity binds under a profile ----------------------------------------------------


async def test_a_request_that_can_never_fit_the_profiles_cache_gets_400(
    make_client: ClientFactory,
) -> None:
    async with make_client(profile=H100, num_slots=8, kv_cache_tokens=4096) as client:
        body = {"prompt": list(range(100)) * 50, "max_tokens": 10, "stream": False}
        r = await client.post("/generate", json=body)
    assert r.status_code == 400
    assert r.headers["x-slotserve-error-code"] == "context_length_exceeded"
    assert "KV cache (4096 tokens)" in r.json()["error"]["message"]


def test_the_profiles_own_kv_capacity_preempts_and_every_request_completes_exactly() -> None:
    """256 requests of 1,600 prompt and 400 generated tokens want 512,000 tokens at once: more
    than the 426,784 of the H100 profile. Admissions wait, then the youngest are preempted;
    everyone completes with exactly the tokens it gets alone, and usage never exceeds 1."""
    settings = Settings(profile=H100, mock_stop_probability=0.0)
    language = MockLanguage(stop_probability=0.0)
    scheduler = Scheduler(engine_config(settings))
    runner = make_runner(CachedMockModel(settings.num_slots, language), settings.num_slots)
    seqs = [
        Sequence(f"r{i}", [i % 250] * 8 + [65 + i % 26] * 1592, 400, frozenset({256}))
        for i in range(settings.num_slots)
    ]
    for s in seqs:
        scheduler.add(s, 0.0)
    preempted, peak = 0, 0.0
    while scheduler.has_work():
        out = scheduler.schedule(0.0)
        preempted += len(out.preempted)
        scheduler.update(out, runner.execute(out), 0.0)
        peak = max(peak, scheduler.books.usage(scheduler.slots.running()))
    assert preempted > 0 and peak <= 1.0
    alone = MockModel(language)
    for s in seqs[::37]:  # a sample: each reference run costs a model call per token
        assert s.status is RequestStatus.FINISHED
        assert s.generated == run_alone(alone, s.prompt, 400, 256, False)
    assert all(len(s.generated) == 400 for s in seqs)
