"""The load generator's math on synthetic timestamps: vllm bench serve's definitions of TTFT,
TPOT, ITL, E2EL, throughput and goodput, and the batch schedule's ideal step counts."""

from __future__ import annotations

import math

import pytest

from app.bench.client import RequestResult
from app.bench.metrics import parse_slo, percentile, request_times, stats_ms, summarize
from app.bench.schedule import continuous_steps, static_steps


def result(sent: float, chunks: list[float], tokens: int, status: str = "completed",
           group: str = "all") -> RequestResult:  # fmt: skip
    r = RequestResult(index=0, group=group, prompt_len=4, sent=sent, chunks=chunks, tokens=tokens)
    r.status = status  # type: ignore[assignment]
    return r


def test_percentiles_interpolate_between_ranks_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_one_request_ttft_e2el_tpot_and_itl() -> None:
    # sent at 10.0; chunks at +0.1, +0.3, +0.4; 5 tokens (one chunk carried 3)
    times = request_times(result(10.0, [10.1, 10.3, 10.4], tokens=5))
    assert times is not None
    assert times.ttft == pytest.approx(0.1)
    assert times.e2el == pytest.approx(0.4)
    assert times.tpot == pytest.approx((0.4 - 0.1) / 4)  # per token, not per chunk
    assert times.itls == pytest.approx([0.2, 0.1])


def test_a_single_token_request_has_no_tpot_and_no_itl() -> None:
    times = request_times(result(0.0, [0.05], tokens=1))
    assert times is not None and times.tpot is None and times.itls == []
    assert request_times(result(0.0, [], tokens=0)) is None


def test_summary_counts_every_status_but_times_only_completed_requests() -> None:
    results = [
        result(0.0, [0.1, 0.2], tokens=2),
        result(0.0, [0.3, 0.5], tokens=3),
        result(0.0, [0.01], tokens=1, status="cancelled"),
        result(0.0, [], tokens=0, status="failed"),
    ]
    results[3].error = "HTTP 429: queue full"
    s = summarize(results, duration_s=2.0)
    assert (s.requests, s.completed, s.cancelled, s.failed) == (4, 2, 1, 1)
    assert s.output_tokens == 5 and s.received_tokens == 6 and s.output_chunks == 4
    assert s.request_throughput == 1.0 and s.output_throughput == 2.5
    assert s.ttft_ms.mean == pytest.approx(200.0) and s.ttft_ms.count == 2
    assert s.tpot_ms.count == 2
    assert s.tpot_ms.p50 == pytest.approx((100.0 + 100.0) / 2)
    assert s.itl_ms.count == 2 and s.itl_ms.mean == pytest.approx(150.0)
    assert s.goodput is None
    assert s.errors == {"HTTP 429: queue full": 1}


def test_goodput_counts_requests_meeting_every_slo_per_second() -> None:
    fast = result(0.0, [0.05, 0.10], tokens=2)  # ttft 50 ms, tpot 50 ms
    slow_start = result(0.0, [0.50, 0.55], tokens=2)  # ttft 500 ms
    slow_tokens = result(0.0, [0.05, 0.45], tokens=2)  # tpot 400 ms
    slo = parse_slo("ttft_ms=100, tpot_ms=100")
    s = summarize([fast, slow_start, slow_tokens], duration_s=0.5, slo=slo)
    assert s.goodput == pytest.approx(2.0)  # one good request in half a second


def test_empty_stats_are_nan_not_an_error() -> None:
    s = stats_ms([])
    assert s.count == 0 and math.isnan(s.p99)
    assert s.as_dict() == {"mean": None, "p50": None, "p90": None, "p99": None}


@pytest.mark.parametrize("text", ["ttft=5", "ttft_ms", "ttft_ms=fast", "tpot_ms=0"])
def test_a_bad_slo_is_refused_with_its_part_named(text: str) -> None:
    with pytest.raises(ValueError, match=text.split(",")[0][:6]):
        parse_slo(text)


def test_static_batches_last_as_long_as_their_longest_request() -> None:
    lengths = [10, 1, 1, 1, 10, 1]
    assert static_steps(lengths, 2) == 10 + 1 + 10
    assert continuous_steps(lengths, 2) == 13  # slot A: 10 then 1; slot B: 1, 1, 1 then 10
    assert continuous_steps([5] * 4, 4) == 5 == static_steps([5] * 4, 4)


def test_the_summary_warns_when_a_worker_saturated_a_core() -> None:
    from rich.console import Console

    from app.bench.report import print_summary
    from app.bench.runner import RunOutput

    def printed(cpu: list[float]) -> str:
        console = Console(record=True, width=120)
        run = RunOutput([result(0.0, [0.1, 0.2], tokens=2)], duration_s=1.0, worker_cpu=cpu)
        print_summary(console, run, {})
        return console.export_text()

    assert "may be the bottleneck" in printed([0.5, 0.95])
    assert "bottleneck" not in printed([0.5, 0.6])
