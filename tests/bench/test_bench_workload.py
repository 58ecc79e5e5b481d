"""What the load generator sends: length specs, seeded workloads, arrivals and the
long-among-short preset; and its SSE decoder, which must see the same events however the
bytes are cut."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.bench.client import NativeTarget, OpenAITarget, count_token_ids
from app.bench.sse import SSEDecoder
from app.bench.workload import WorkloadConfig, WorkloadError, build, parse_lengths


def config(**overrides: object) -> WorkloadConfig:
    base: dict[str, object] = {"num_requests": 500, "prompt_len": parse_lengths("8"),
                               "output_len": parse_lengths("exp:128:512")}  # fmt: skip
    return WorkloadConfig(**(base | overrides))  # type: ignore[arg-type]


def test_length_specs() -> None:
    assert str(parse_lengths("64")) == "64"
    assert str(parse_lengths("uniform:1:9")) == "uniform:1:9"
    assert str(parse_lengths("exp:128:1536")) == "exp:128:1536"
    assert str(parse_lengths("exp:128:32")) == "exp:128:32"  # a cap below the mean: Anyscale


@pytest.mark.parametrize("text", ["x", "-1", "exp:0:5", "exp:9:0", "uniform:5:1", "gauss:1:2"])
def test_a_bad_length_spec_is_refused(text: str) -> None:
    with pytest.raises(WorkloadError):
        parse_lengths(text)


def test_a_seed_gives_the_same_workload_and_another_seed_another() -> None:
    assert build(config(seed=3)) == build(config(seed=3))
    assert build(config(seed=3)) != build(config(seed=4))


def test_capped_exponential_lengths_follow_anyscales_recipe() -> None:
    lengths = [s.max_tokens for s in build(config(num_requests=4000))]
    assert max(lengths) == 512 and min(lengths) >= 1
    assert 105 < statistics.mean(lengths) < 135  # mean 128, lowered a little by the cap


def test_poisson_arrivals_have_the_asked_rate_and_all_at_once_means_zero() -> None:
    times = [s.send_at for s in build(config(num_requests=2000, request_rate=50.0))]
    assert times == sorted(times) and times[0] == 0.0
    assert 1900 / 50 * 0.9 < times[-1] < 2000 / 50 * 1.1
    assert {s.send_at for s in build(config())} == {0.0}


def test_long_among_short_sends_the_long_ones_first_then_short_ones() -> None:
    specs = build(config(preset="long-among-short", long_requests=3, request_rate=10.0))
    assert [s.group for s in specs[:4]] == ["long", "long", "long", "short"]
    assert {s.max_tokens for s in specs[:3]} == {2000}
    assert {s.max_tokens for s in specs[3:]} == {20}
    assert [s.send_at for s in specs[:3]] == [0.0, 0.0, 0.0]


def test_cancel_rate_marks_that_fraction_with_a_point_inside_the_output() -> None:
    specs = build(config(num_requests=2000, cancel_rate=0.25))
    cancelled = [s for s in specs if s.cancel_after is not None]
    assert 0.2 < len(cancelled) / len(specs) < 0.3
    assert all(1 <= s.cancel_after < s.max_tokens for s in cancelled if s.cancel_after)


@pytest.mark.parametrize("bad", [{"num_requests": 0}, {"request_rate": 0.0},
                                 {"cancel_rate": 1.5}, {"preset": "nope"}])  # fmt: skip
def test_a_bad_workload_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(WorkloadError):
        build(config(**bad))


STREAM = (
    b": ping\r\n\r\n"
    b'event: token\ndata: {"request_id":"a","tokens":[1,2,3],"text":"x]y"}\n\n'
    b'event: token\ndata: {"request_id":"a","tokens":[],"text":""}\n\n'
    b'data: {"choices":[{"text":"hi"}]}\r\n\r\n'
    b"data: line1\ndata: line2\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    ("token", b'{"request_id":"a","tokens":[1,2,3],"text":"x]y"}'),
    ("token", b'{"request_id":"a","tokens":[],"text":""}'),
    ("message", b'{"choices":[{"text":"hi"}]}'),
    ("message", b"line1\nline2"),
    ("message", b"[DONE]"),
]


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_sse_decoder_yields_the_same_events_however_the_bytes_are_cut(cuts: list[int]) -> None:
    decoder, events, last = SSEDecoder(), [], 0
    for cut in [*sorted(cuts), len(STREAM)]:
        events += decoder.feed(STREAM[last:cut])
        last = cut
    assert events == EXPECTED


def test_native_events_count_token_ids_and_openai_chunks_count_text() -> None:
    assert count_token_ids(EXPECTED[0][1]) == 3
    assert count_token_ids(EXPECTED[1][1]) == 0
    assert count_token_ids(b'{"tokens": [4, 5], "text": "]"}') == 2  # json.dumps spacing
    native = NativeTarget()
    assert native.parse("done", b'{"finish_reason":"length"}').end
    assert native.parse("error", b'{"error":{"message":"boom"}}').error == "boom"
    openai = OpenAITarget()
    assert openai.parse("message", EXPECTED[2][1]).tokens == 1
    usage = openai.parse("message", b'{"choices":[],"usage":{"completion_tokens":7}}')
    assert usage.total_tokens == 7 and usage.tokens == 0
    assert openai.parse("message", b"[DONE]").end


async def test_an_event_that_is_not_json_fails_that_request_only() -> None:
    import httpx

    from app.bench.client import send
    from app.bench.workload import RequestSpec

    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=httpx.ByteStream(b"data: {not json\n\n"))

    transport = httpx.MockTransport(reply)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        result = await send(client, OpenAITarget(), RequestSpec(0, (1, 2), 4, 0.0))
    assert result.status == "failed" and result.error and "bad event" in result.error
