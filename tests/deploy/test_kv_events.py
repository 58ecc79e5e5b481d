"""KV events (``--kv-events-endpoint``): a pyzmq subscriber decodes every batch with vLLM's
event schema (written here from ``vllm/distributed/kv_events.py``, independently of
app/kv_events/schema.py) and keeps the books: blocks stored minus blocks removed equal the
prefix cache's contents, with the hashes a router computes from token ids (vLLM's
``hash_block_tokens``, reimplemented here). Replays fill a missed sequence; nothing about events
can stall or kill the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from kv_subscriber import (
    BS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Recent,
    Subscriber,
    V026Batch,
    chain_tokens,
    vllm_hashes,
)

from app.cli import parse
from app.config import Settings
from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.prefix_cache import CachedBlock, CacheEvent, CacheEventKind
from app.engine.types import Sequence
from app.kv_events import replay
from app.kv_events.hashing import BlockHasher
from app.kv_events.publisher import KVEventPublisher, KVEventsConfig, KVEventsError
from app.kv_events.replay import CHUNK as REPLAY_CHUNK
from app.models.cached_mock import CachedMockModel
from app.serving import Serving


def config(tmp_path: Path, **kw: Any) -> KVEventsConfig:
    kw.setdefault("encoding", "array")  # (the legacy schema above; map layouts tested below)
    return KVEventsConfig(f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay", block_size=BS, **kw)


def engine_config() -> EngineConfig:
    return EngineConfig(
        num_slots=6, max_waiting=1000, max_num_batched_tokens=24, block_size=BS,
        kv_cache_tokens=40 * BS, max_model_len=30 * BS, enable_prefix_caching=True,
        record_kv_events=True,
    )  # fmt: skip


def workload(n: int, rng: random.Random) -> list[Sequence]:
    """Prompts sharing one of three prefixes (2-5 blocks), plus own tails."""
    heads = [[rng.randrange(1, 250) for _ in range(rng.randrange(2, 6) * BS)] for _ in range(3)]
    seqs = []
    for i in range(n):
        tail = [rng.randrange(1, 250) for _ in range(rng.randrange(0, 3 * BS))]
        seqs.append(Sequence(f"r{i}", [*rng.choice(heads), *tail, 1], rng.randrange(1, 9),
                             frozenset({0})))  # fmt: skip
    return seqs


async def run(engine: Engine, seqs: list[Sequence]) -> None:
    streams = [engine.submit(seq) for seq in seqs]
    await asyncio.gather(*(stream.collect() for stream in streams))


def expected_books(engine: Engine) -> set[int | bytes]:
    cache = engine.core.scheduler.prefix_cache
    assert cache is not None
    return {vllm_hashes(chain_tokens(b), lora=b.lora)[-1] for b in cache.blocks()}


async def settle(publisher: KVEventPublisher, sub: Subscriber) -> None:
    """Receive until the subscriber holds every batch the engine numbered (replaying what the
    SUB socket missed: its first batches go out before it has joined)."""
    last = publisher._next_seq - 1
    for _ in range(200):
        await asyncio.to_thread(sub.receive, 20)
        if last in sub.batches:
            break
    missing = set(range(last + 1)) - set(sub.batches)
    if missing:
        sub.replay_from(min(missing))
    assert set(sub.batches) == set(range(last + 1))


async def test_the_books_balance_after_a_shared_prefix_workload(tmp_path: Path) -> None:
    publisher = KVEventPublisher(config(tmp_path, topic="kv@test"))
    sub = Subscriber(publisher.endpoint, str(publisher.replay_endpoint), b"kv@")
    engine = Engine(CachedMockModel(6), engine_config(), kv_events=publisher)
    await engine.start()
    try:
        await run(engine, workload(60, random.Random(1)))
        await settle(publisher, sub)
        books = sub.books()
        assert books == expected_books(engine)
        assert len(books) > 5
        kinds = {type(e) for b in sub.batches.values() for e in b.events}
        assert kinds == {BlockStored, BlockRemoved}  # the workload overflows the cache
        assert publisher.dropped == 0
        # a reset: the free blocks go, and an idle cache is cleared in one event
        assert await engine.reset_prefix_cache()
        await settle(publisher, sub)
        assert isinstance(sub.batches[max(sub.batches)].events[-1], AllBlocksCleared)
        assert sub.books() == set() == expected_books(engine)
        # checked last: the SUB socket has surely joined by the reset (on a loaded machine the
        # whole workload can go out before it does, and come back by replay, topic-less)
        assert sub.topics == {b"kv@test"}
    finally:
        await engine.stop()
        publisher.close()
        sub.close()


async def test_vllm_mains_map_batch_encoding_balances_the_books_too(tmp_path: Path) -> None:
    publisher = KVEventPublisher(config(tmp_path, encoding="map-batch"))
    decoder = msgspec.msgpack.Decoder(Recent.KVEventBatch)
    sub = Subscriber(publisher.endpoint, str(publisher.replay_endpoint), decoder=decoder)
    engine = Engine(CachedMockModel(6), engine_config(), kv_events=publisher)
    await engine.start()
    try:
        await run(engine, workload(30, random.Random(5)))
        await settle(publisher, sub)
        assert sub.books() == expected_books(engine)
        first = msgspec.msgpack.decode(publisher._buffer[0][1])
        assert set(first) == {"ts", "events", "data_parallel_rank"}
        assert first["events"][0]["type"] == "BlockStored"
    finally:
        await engine.stop()
        publisher.close()
        sub.close()


async def test_the_default_encoding_is_released_vllms_map_events(tmp_path: Path) -> None:
    """Review finding 1: the default was vLLM's old positional layout, which vLLM 0.24+
    subscribers reject. The default now sends map events in an array batch (vLLM 0.24-0.26),
    decoded here with that schema, and ``extra_keys`` per block (the adapter's name)."""
    assert Settings().kv_events_encoding == "map" == KVEventsConfig("inproc://x").encoding
    publisher = KVEventPublisher(config(tmp_path, encoding="map"))
    decoder = msgspec.msgpack.Decoder(V026Batch)
    sub = Subscriber(publisher.endpoint, str(publisher.replay_endpoint), decoder=decoder)
    engine = Engine(CachedMockModel(6), dataclasses.replace(engine_config(), max_loras=2),
                    kv_events=publisher)  # fmt: skip
    await engine.start()
    try:
        seqs = workload(20, random.Random(6))
        for i, seq in enumerate(seqs):
            seq.lora = ("sql", None)[i % 2]
        await run(engine, seqs)
        await settle(publisher, sub)
        assert sub.books() == expected_books(engine)
        raw = msgspec.msgpack.decode(publisher._buffer[0][1])
        assert isinstance(raw, list) and raw[1][0]["type"] == "BlockStored"
        stored = [e for b in sub.batches.values() for e in b.events
                  if isinstance(e, Recent.BlockStored)]  # fmt: skip
        for event in stored:
            extra = None if event.lora_name is None else (event.lora_name,)
            assert event.extra_keys == [extra] * len(event.block_hashes)
        assert {e.lora_name for e in stored} == {None, "sql"}
    finally:
        await engine.stop()
        publisher.close()
        sub.close()


async def test_a_subscriber_that_missed_batches_gets_them_replayed(tmp_path: Path) -> None:
    publisher = KVEventPublisher(config(tmp_path))
    sub = Subscriber(publisher.endpoint, str(publisher.replay_endpoint))
    engine = Engine(CachedMockModel(6), engine_config(), kv_events=publisher)
    await engine.start()
    rng = random.Random(2)
    try:
        await run(engine, workload(20, rng))
        await settle(publisher, sub)
        seen = max(sub.batches)
        sub.sub.close(linger=0)  # it goes away; the engine goes on
        await run(engine, workload(20, rng))
        sub.sub = sub.ctx.socket(zmq.SUB)
        sub.sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.sub.connect(publisher.endpoint)
        assert publisher._next_seq - 1 > seen
        replayed = sub.replay_from(seen + 1)
        assert replayed == list(range(seen + 1, publisher._next_seq))
        assert sub.books() == expected_books(engine)
    finally:
        await engine.stop()
        publisher.close()
        sub.close()


async def test_a_replay_from_before_the_buffer_starts_where_it_starts(tmp_path: Path) -> None:
    publisher = KVEventPublisher(config(tmp_path, buffer_steps=3))
    sub = Subscriber(publisher.endpoint, str(publisher.replay_endpoint))
    engine = Engine(CachedMockModel(6), engine_config(), kv_events=publisher)
    await engine.start()
    try:
        await run(engine, workload(20, random.Random(3)))
        last = publisher._next_seq - 1
        for _ in range(200):  # the thread has sent the last batch once it is in the buffer
            if any(seq == last for seq, _ in list(publisher._buffer)):
                break
            await asyncio.sleep(0.01)
        assert sub.replay_from(0) == [last - 2, last - 1, last]  # a gap the client can see
    finally:
        await engine.stop()
        publisher.close()
        sub.close()


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_block_hashes_follow_vllm(algo: str) -> None:
    tokens = list(range(3, 3 + 5 * BS + 2))
    hasher = BlockHasher(algo, "42")  # type: ignore[arg-type]
    ours = [int.from_bytes(d, "big") & ((1 << 64) - 1) for d in hasher.token_hashes(tokens, BS)]
    assert ours == vllm_hashes(tokens, algo, "42")
    parent = None
    for i in range(5):  # the memoized chain hash of cache blocks agrees
        parent = CachedBlock(i, parent, tuple(tokens[i * BS : (i + 1) * BS]))
    assert parent is not None
    assert hasher.digest(parent) == hasher.token_hashes(tokens, BS)[-1]


async def test_lora_blocks_are_their_adapters_own(tmp_path: Path) -> None:
    """The same prompt under two adapters and the base model: three chains, hashed with the
    adapter's name as vLLM's extra key, ``lora_name`` on each ``BlockStored``."""
    publisher = KVEventPublisher(config(tmp_path))
    sub = Subscriber(publisher.endpoint, str(publisher.replay_endpoint))
    engine_cfg = dataclasses.replace(engine_config(), max_loras=2)
    engine = Engine(CachedMockModel(6), engine_cfg, kv_events=publisher)
    await engine.start()
    try:
        prompt = [*range(10, 10 + 3 * BS), 1]
        seqs = [Sequence(f"r{i}", list(prompt), 2, frozenset({0}), lora=lora)
                for i, lora in enumerate((None, "sql", "chat"))]  # fmt: skip
        await run(engine, seqs)
        await settle(publisher, sub)
        stored = [e for b in sub.batches.values() for e in b.events if isinstance(e, BlockStored)]
        names: dict[str | None, list[int | bytes]] = {}
        for event in stored:  # (chunked prefill: a prompt's blocks over several events)
            names.setdefault(event.lora_name, []).extend(event.block_hashes)
        assert set(names) == {None, "sql", "chat"}
        for lora, hashes in names.items():
            assert hashes == vllm_hashes(prompt, lora=lora)
        assert sub.books() == expected_books(engine)
    finally:
        await engine.stop()
        publisher.close()
        sub.close()


class Exploding:
    def publish(self, events: list[CacheEvent]) -> None:
        raise RuntimeError("boom")


async def test_a_failing_sink_is_contained_and_counted() -> None:
    engine = Engine(CachedMockModel(6), engine_config(), kv_events=Exploding())
    await engine.start()
    try:
        seqs = workload(10, random.Random(4))
        await run(engine, seqs)
        assert all(s.finish_reason is not None and s.error is None for s in seqs)
        assert engine.core.observer_errors["publish:RuntimeError"] > 0
    finally:
        await engine.stop()


def _stalled(publisher: KVEventPublisher) -> threading.Event:
    """Hold the publisher's thread in its first send until the returned event is set."""
    gate = threading.Event()
    original = publisher._send

    def stuck(*args: Any) -> None:
        gate.wait(5)
        original(*args)

    publisher._send = stuck  # type: ignore[method-assign,assignment]
    return gate


def _sent(publisher: KVEventPublisher) -> list[tuple[int, int]]:
    """(sequence number, number of events) of every batch sent, in order."""
    return [(seq, len(msgspec.msgpack.decode(payload)[1])) for seq, payload in publisher._buffer]


CLEARED = CacheEvent(CacheEventKind.CLEARED)


def test_a_full_queue_delays_events_into_the_next_batch_without_blocking(tmp_path: Path) -> None:
    """Review finding 2: a step whose batch found the queue full was dropped, a gap no replay
    could fill. Its events now ride in the next batch (or the thread sends them once the queue
    has drained): every event arrives, the numbers have no gap, nothing is dropped."""
    publisher = KVEventPublisher(config(tmp_path, max_queue_size=1))
    gate = _stalled(publisher)
    try:
        for _ in range(6):
            publisher.publish([CLEARED])  # one in the thread's hands, one queued, 4 held back
        assert publisher.dropped == 0
    finally:
        gate.set()
        publisher.close(timeout=5)
    sent = _sent(publisher)
    assert [seq for seq, _ in sent] == list(range(len(sent)))
    assert sum(n for _, n in sent) == 6 and publisher.dropped == 0


def test_events_past_the_pending_cap_are_dropped_as_a_visible_gap(tmp_path: Path) -> None:
    publisher = KVEventPublisher(config(tmp_path, max_queue_size=1, max_pending_events=2))
    gate = _stalled(publisher)
    try:
        for _ in range(6):
            publisher.publish([CLEARED])
        assert publisher.dropped >= 1
    finally:
        gate.set()
        publisher.close(timeout=5)
    seqs = [seq for seq, _ in _sent(publisher)]
    assert len(seqs) + publisher.dropped == publisher._next_seq  # each drop: a number skipped


def test_a_flooding_replay_client_does_not_starve_publishing(tmp_path: Path) -> None:
    """Review finding 2: a client asking again and again for a long replay kept the thread in
    its replay loop while the queue overflowed and batches were dropped. One request is served
    at a time, in chunks, with the queue sent in between; nothing is lost."""
    publisher = KVEventPublisher(config(tmp_path, max_queue_size=50, buffer_steps=5000))
    for _ in range(1500):
        publisher.publish([CLEARED])
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.connect(str(publisher.replay_endpoint))
    try:
        for _ in range(200):  # never read: the answers pile up
            flood.send_multipart((b"", (0).to_bytes(8, "big")))
        for _ in range(3000):
            publisher.publish([CLEARED])
    finally:
        publisher.close(timeout=30)
        flood.close(linger=0)
        ctx.term()
    sent = _sent(publisher)
    assert publisher.dropped == 0
    assert [seq for seq, _ in sent] == list(range(publisher._next_seq))
    assert sum(n for _, n in sent) == 4500


def test_a_long_replay_comes_whole_over_several_turns(tmp_path: Path) -> None:
    publisher = KVEventPublisher(config(tmp_path))
    sub = Subscriber(publisher.endpoint, str(publisher.replay_endpoint))
    try:
        for _ in range(3 * REPLAY_CHUNK + 7):
            publisher.publish([CLEARED])
        for _ in range(500):  # (the thread has sent them all once the last is buffered)
            if publisher._buffer and publisher._buffer[-1][0] == publisher._next_seq - 1:
                break
            threading.Event().wait(0.01)
        assert sub.replay_from(5) == list(range(5, publisher._next_seq))
    finally:
        publisher.close()
        sub.close()


def test_bad_endpoints_are_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--kv-events-endpoint", "tcp://nowhere", "--enable-prefix-caching"],
                 ["--kv-events-endpoint", "tcp://*:5557"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse(["serve", *argv])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "--kv-events-endpoint" in err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--kv-events-endpoint", "ipc:///tmp/kv", "--kv-events-replay-endpoint", "ipc:///tmp/kv"],
         "ipc:///tmp/kv is used twice"),
        (["--kv-events-endpoint", "inproc://kv", "--kv-events-replay-endpoint", "inproc://kv_dp1",
          "--data-parallel-size", "2"], "inproc://kv_dp1 is used twice"),
        (["--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558",
          "--data-parallel-size", "2"], "port 5558 is used twice"),
        (["--kv-events-endpoint", "tcp://*:8660", "--port", "8660"], "takes --port 8660"),
        (["--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint",
          "tcp://127.0.0.1:8661", "--port", "8661"], "takes --port 8661"),
    ],
)  # fmt: skip
def test_endpoint_clashes_are_refused_in_one_line(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review finding 6: PUB and replay on one ipc path were accepted (the ROUTER's bind took
    the path, subscribers got nothing), and a KV-event port equal to --port failed later with
    uvicorn's generic address-in-use."""
    with pytest.raises(SystemExit):
        parse(["serve", "--enable-prefix-caching", *flags])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err and "-endpoint" in err


def test_a_port_in_use_is_refused_at_start(tmp_path: Path) -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        settings = Settings(enable_prefix_caching=True, kv_events_endpoint=f"tcp://*:{port}")
        with pytest.raises(KVEventsError, match=f"cannot open tcp://\\*:{port}"):
            Serving(settings)
    finally:
        taken.close(linger=0)
        ctx.term()


def test_a_refused_start_leaves_no_publisher_behind(tmp_path: Path) -> None:
    """Rank 1's port is taken: rank 0's publisher, already open, is closed again."""
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=30000)
    try:
        settings = Settings(enable_prefix_caching=True, data_parallel_size=2,
                            kv_events_endpoint=f"tcp://*:{port - 1}")  # fmt: skip
        before = {t.name for t in threading.enumerate()}
        with pytest.raises(KVEventsError, match=f":{port}"):
            Serving(settings)
        assert "slotserve-kv-events" not in {t.name for t in threading.enumerate()} - before
        rebound = ctx.socket(zmq.PUB)
        rebound.bind(f"tcp://*:{port - 1}")  # rank 0's port is free again
        rebound.close(linger=0)
    finally:
        taken.close(linger=0)
        ctx.term()


def test_non_reading_replay_clients_are_dropped_then_reset_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27: a replay client that never reads is dropped once its queue is full and it
    takes nothing for the stall time; past ``max_replay_clients`` such clients the socket is
    reset (ZeroMQ frees their queues), and a reading client then gets a whole replay (asking
    again after a silence, as clients do). ipc endpoints: the reset binds the path again."""
    monkeypatch.setattr(replay, "STALL_SECONDS", 0.2)
    publisher = KVEventPublisher(config(tmp_path, max_replay_clients=2))
    block = CachedBlock(1, None, tuple(range(1000)))  # ~3 KB a batch: past kernel buffers
    for _ in range(600):
        publisher.publish([CacheEvent(CacheEventKind.STORED, (block,))])
    ctx = zmq.Context()
    hoarders = []
    try:
        for _ in range(500):  # (the thread has sent them all once the last is buffered)
            if publisher._buffer and publisher._buffer[-1][0] == publisher._next_seq - 1:
                break
            threading.Event().wait(0.01)
        for _ in range(3):  # the third is ignored: two clients hold unread answers
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(str(publisher.replay_endpoint))
            sock.send_multipart((b"", (0).to_bytes(8, "big")))
            hoarders.append(sock)
        server = publisher._replay
        assert server is not None
        for _ in range(300):
            if server.dropped == 2:
                break
            threading.Event().wait(0.01)
        assert (server.dropped, server.refused, server.resets) == (2, 1, 0)
        reader = Subscriber(publisher.endpoint, str(publisher.replay_endpoint))
        reader.replay.send_multipart((b"", (0).to_bytes(8, "big")))
        assert not reader.replay.poll(500)  # this request reset the socket, and went with it
        assert server.resets == 1
        assert reader.replay_from(0) == list(range(600))
        reader.close()
    finally:
        for sock in hoarders:
            sock.close(linger=0)
        ctx.term()
        publisher.close()
