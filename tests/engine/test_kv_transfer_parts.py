"""The parts of prefill/decode disaggregation that need no server: vLLM's config and parameter
shapes, the producer's held blocks, the link's timing and which peers a pull may reach."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.kv_transfer import pull as pull_module
from app.kv_transfer.config import parse_kv_transfer_config
from app.kv_transfer.holds import Holds
from app.kv_transfer.link import Link
from app.kv_transfer.params import RemoteBlocks, TransferParamsError, parse_transfer_params
from app.kv_transfer.pull import trusted

PRODUCER_ANSWER = {  # what vLLM's NIXL connector answers a prefill (and the router passes on)
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5, 6],
    "remote_engine_id": "e-1", "remote_request_id": "cmpl-1", "remote_host": "10.0.0.7",
    "remote_port": 8100, "tp_size": 1,
}  # fmt: skip


def test_the_config_takes_vllms_json_and_names_what_is_wrong() -> None:
    config = parse_kv_transfer_config('{"kv_connector":"NixlConnector","kv_role":"kv_both"}')
    assert config.produces and config.consumes and len(config.engine_id) == 36
    consumer = parse_kv_transfer_config(
        '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","engine_id":"d"}'
    )
    assert consumer.consumes and not consumer.produces and consumer.engine_id == "d"
    for text, words in [
        ("[]", "JSON object"),
        ("{", "not JSON"),
        ('{"kv_connector":"Nope","kv_role":"kv_both"}', "kv_connector"),
        ('{"kv_connector":"NixlConnector","kv_role":"both"}', "kv_role"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_kv_transfer_config(text)


def test_the_routers_prefill_params_ask_to_hold_and_the_producers_answer_asks_to_pull() -> None:
    router_prefill = {"do_remote_decode": True, "do_remote_prefill": False,
                      "remote_engine_id": None, "remote_block_ids": None,
                      "remote_host": None, "remote_port": None}  # fmt: skip
    intent = parse_transfer_params(router_prefill)
    assert intent is not None and intent.remote_decode and intent.remote_prefill is None
    pull = parse_transfer_params(PRODUCER_ANSWER)
    assert pull is not None and pull.remote_prefill is not None
    assert pull.remote_prefill.block_ids == (4, 5, 6) and pull.remote_prefill.port == 8100
    grouped = parse_transfer_params({**PRODUCER_ANSWER, "remote_block_ids": [[4, 5]]})
    assert grouped is not None and grouped.remote_prefill is not None
    assert grouped.remote_prefill.block_ids == (4, 5)
    assert parse_transfer_params(None) is None and parse_transfer_params({}) is None


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"remote_port": 0}, "kv_transfer_params.remote_port"),
        ({"remote_port": "8100"}, "kv_transfer_params.remote_port"),
        ({"remote_block_ids": [1, -2]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": "1,2"}, "kv_transfer_params.remote_block_ids"),
        ({"remote_engine_id": None}, "kv_transfer_params.remote_engine_id"),
        ({"remote_host": "x" * 300}, "kv_transfer_params.remote_host"),
        ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill"),
        ({"do_remote_decode": True}, "kv_transfer_params"),
    ],
)
def test_params_of_the_wrong_shape_name_their_field(change: dict[str, object], param: str) -> None:
    with pytest.raises(TransferParamsError) as caught:
        parse_transfer_params({**PRODUCER_ANSWER, **change})
    assert caught.value.param == param


def test_held_blocks_count_until_pulled_or_expired_and_the_oldest_goes_past_the_bound() -> None:
    holds = Holds(total_blocks=10, hold_seconds=5.0, max_held=2)
    first = holds.hold("a", 3, 40, now=0.0)
    holds.hold("b", 2, 20, now=1.0)
    assert holds.blocks == 5 and first.block_ids == (0, 1, 2)
    taken = holds.take("a")
    assert taken is not None and taken.num_tokens == 40 and holds.blocks == 2
    assert holds.take("a") is None  # a second pull finds nothing
    holds.hold("c", 1, 10, now=2.0)
    holds.hold("d", 1, 10, now=3.0)  # past max_held: "b", the oldest, is let go
    assert holds.take("b") is None and holds.expired == 1 and holds.blocks == 2
    assert holds.expire(now=7.5) == 1 and holds.take("c") is None and holds.blocks == 1
    assert holds.expire(now=8.0) == 1 and holds.blocks == 0


def test_holds_never_take_more_than_half_the_cache() -> None:
    """Prefills nobody pulls (a client asking for holds it never fetches) cannot starve the
    cache: past half its blocks the oldest hold goes, as if it expired."""
    holds = Holds(total_blocks=10, hold_seconds=60.0)
    holds.hold("a", 3, 48, now=0.0)
    holds.hold("b", 2, 32, now=0.0)
    holds.hold("c", 2, 32, now=0.0)  # 7 > 5: "a" goes
    assert holds.take("a") is None and holds.blocks == 4 and holds.expired == 1


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 4), st.booleans())))
def test_held_blocks_always_equal_the_sum_of_the_holds(ops: list[tuple[str, int, bool]]) -> None:
    holds, reference = Holds(total_blocks=7, max_held=3), dict[str, int]()
    for now, (rid, blocks, take) in enumerate(ops):
        if take:
            assert (holds.take(rid) is not None) == (rid in reference)
            reference.pop(rid, None)
        else:
            reference.pop(rid, None)
            while reference and (len(reference) >= 3 or sum(reference.values()) + blocks > 3):
                reference.pop(next(iter(reference)))  # past 3 holds or half the 7 blocks
            holds.hold(rid, blocks, blocks * 16, float(now))
            reference[rid] = blocks
        assert holds.blocks == sum(reference.values()) and len(holds) == len(reference)


def test_the_link_time_is_latency_plus_bytes_over_bandwidth() -> None:
    link = Link(kv_bytes_per_token=131_072, bandwidth_gbps=50.0, latency_ms=1.0)
    assert link.seconds(0) == pytest.approx(0.001)
    assert link.seconds(1000) == pytest.approx(0.001 + 131_072_000 / 50e9)


def test_a_pull_only_reaches_trusted_peers() -> None:
    assert trusted("127.0.0.1", None) and trusted("10.1.2.3", None) and trusted("::1", None)
    assert trusted("localhost", None)
    assert not trusted("8.8.8.8", None) and not trusted("169.254.169.254", None)
    assert not trusted("metadata.google.internal", None)
    assert trusted("prefill-0.svc", frozenset({"prefill-0.svc"}))
    assert not trusted("127.0.0.1", frozenset({"prefill-0.svc"}))


class Trickle(httpx.AsyncByteStream):
    """A peer that answers its headers, then one byte every 10 ms, never finishing."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0.01)
            yield b" "


async def test_a_peer_trickling_its_answer_is_cut_off_at_the_pull_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pull_module, "PULL_TIMEOUT", 0.2)  # each byte comes well within it
    answer = httpx.MockTransport(lambda _: httpx.Response(200, stream=Trickle()))
    blocks = RemoteBlocks("prod", "r", (0, 1), "127.0.0.1", 8000)
    async with httpx.AsyncClient(transport=answer) as client:
        pulled = await asyncio.wait_for(pull_module.pull(client, blocks), 2)
    assert pulled.failure == "unreachable"
