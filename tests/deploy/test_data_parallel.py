"""Data-parallel ranks (``--data-parallel-size N``): N engines behind one port, each with its
own slots, queue, prefix cache and step clock; a request goes to the least-loaded rank or to
the rank ``x-data-parallel-rank`` names; metrics carry vLLM's ``engine`` label, /slots shows
every rank, KV events carry the rank (and use the rank's own endpoint, as vLLM offsets it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from conftest import ClientFactory, serving_of
from kv_subscriber import Subscriber, V026Batch, chain_tokens, vllm_hashes
from prometheus_client.parser import text_string_to_metric_families

from app.serving import GenerationParams

RANK = "x-data-parallel-rank"


async def test_requests_spread_over_ranks_and_obey_the_header(make_client: ClientFactory) -> None:
    async with make_client(data_parallel_size=2, num_slots=2, mock_step_ms=1.0) as client:
        serving = serving_of(client)
        streams = [serving.submit(GenerationParams(prompt=[72, 105], max_tokens=5000,
                                                   ignore_eos=True)) for _ in range(4)]  # fmt: skip
        assert [len(e.core.live) for e in serving.engines] == [2, 2]  # least loaded first
        table = (await client.get("/slots")).json()
        assert [r["rank"] for r in table["ranks"]] == [0, 1]
        assert all(r["num_slots"] == 2 for r in table["ranks"])
        for stream in streams:
            serving.abort(stream.request_id)
        body = {"prompt": "Hi ", "max_tokens": 3}
        answer = await client.post("/v1/completions", json=body, headers={RANK: "1"})
        assert answer.status_code == 200
        for bad in ("2", "-1", "x", ""):
            refused = await client.post("/v1/completions", json=body, headers={RANK: bad})
            assert refused.status_code == 400, bad
            assert refused.json()["error"]["param"] == RANK
        # an id live on one rank is a duplicate on the other; a cancel finds its rank
        sent = {**body, "max_tokens": 5000, "stream": False, "request_id": "one"}
        pending = asyncio.create_task(client.post("/generate", json=sent, headers={RANK: "1"}))
        for _ in range(200):
            if "one" in serving.engines[1].core.live:
                break
            await asyncio.sleep(0.005)
        dup = await client.post("/generate", json=sent, headers={RANK: "0"})
        assert dup.status_code == 409
        assert (await client.delete("/requests/one")).status_code == 200
        assert (await pending).json()["finish_reason"] == "abort"
        families = {f.name: f for f in text_string_to_metric_families(
            (await client.get("/metrics")).text)}  # fmt: skip
        done = {"0": 0.0, "1": 0.0}
        for sample in families["vllm:request_success"].samples:
            if sample.labels["finished_reason"] in ("length", "stop"):
                done[sample.labels["engine"]] += sample.value
        assert done == {"0": 0.0, "1": 1.0}  # the completion the header sent to rank 1
        running = families["vllm:num_requests_running"].samples
        assert sorted(s.labels["engine"] for s in running) == ["0", "1"]


async def test_each_rank_publishes_its_own_kv_events(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    async with make_client(data_parallel_size=2, enable_prefix_caching=True, block_size=4,
                           kv_events_endpoint=endpoint,
                           kv_events_replay_endpoint=replay) as client:  # fmt: skip
        serving = serving_of(client)
        publishers = serving.ranks.events
        assert [p.endpoint for p in publishers if p] == [endpoint, f"{endpoint}_dp1"]
        decoder = msgspec.msgpack.Decoder(V026Batch)  # (the default encoding)
        subs = [Subscriber(p.endpoint, str(p.replay_endpoint), decoder=decoder)
                for p in publishers if p]  # fmt: skip
        try:
            shared = "A system prompt shared by every request here. "
            for i in range(6):
                body = {"prompt": shared + str(i), "max_tokens": 2}
                answer = await client.post("/v1/completions", json=body,
                                           headers={RANK: str(i % 2)})  # fmt: skip
                assert answer.status_code == 200
            for rank, (sub, publisher) in enumerate(zip(subs, publishers, strict=True)):
                assert publisher is not None
                for _ in range(200):  # the thread has sent the rank's last batch
                    if publisher.published == publisher._next_seq:
                        break
                    await asyncio.sleep(0.005)
                sub.replay_from(0)
                assert all(b.data_parallel_rank == rank for b in sub.batches.values())
                cache = serving.engines[rank].core.scheduler.prefix_cache
                assert cache is not None and cache.blocks()
                expected = {vllm_hashes(chain_tokens(b))[-1] for b in cache.blocks()}
                assert sub.books(rank) == expected
        finally:
            for sub in subs:
                sub.close()


async def test_sleep_covers_every_rank(make_client: ClientFactory) -> None:
    async with make_client(data_parallel_size=3, enable_sleep_mode=True,
                           mock_step_ms=1.0) as client:  # fmt: skip
        serving = serving_of(client)
        streams = [serving.submit(GenerationParams(prompt=[72, 105], max_tokens=5000,
                                                   ignore_eos=True)) for _ in range(3)]  # fmt: skip
        assert [len(e.core.live) for e in serving.engines] == [1, 1, 1]
        assert (await client.post("/sleep")).status_code == 200
        assert all(s.seq.finish_reason is not None for s in streams)
        assert all(not e.core.live for e in serving.engines)
        refused = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                    headers={RANK: "2"})  # fmt: skip
        assert refused.status_code == 503
        assert (await client.post("/wake_up")).status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_a_non_ascii_digit_rank_header_is_a_400(make_client: ClientFactory) -> None:
    """Review finding 5: ``²`` (latin-1 0xB2, legal in a header) passes ``str.isdigit`` but not
    ``int``: it was a 500; every generation route now refuses it with a 400 naming the header."""
    async with make_client(data_parallel_size=2) as client:
        routes = (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 2}),
                  ("/generate", {"prompt": "Hi", "max_tokens": 2, "stream": False}))  # fmt: skip
        for path, body in routes:
            refused = await client.post(path, json=body, headers={RANK.encode(): b"\xb2"})
            assert refused.status_code == 400, path
            assert refused.json()["error"]["param"] == RANK
        hello = [{"role": "user", "content": "Hi"}]
        adapters = (("/v1/responses", {"input": "Hi", "max_output_tokens": 16}),
                    ("/v1/messages", {"model": "slotserve-mock", "max_tokens": 2,
                                      "messages": hello}))  # fmt: skip
        for path, body in adapters:  # (their own error shapes)
            refused = await client.post(path, json=body, headers={RANK.encode(): b"\xb2"})
            assert refused.status_code == 400, path
            assert RANK in refused.text
            answer = await client.post(path, json=body, headers={RANK: "1"})
            assert answer.status_code == 200, (path, answer.text)
