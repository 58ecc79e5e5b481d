"""KV events on vs off: the engine's time per step at 256 slots with the prefix cache busy.

The workload: requests whose prompts share one of 16 system prompts (8-32 blocks of 16 tokens)
plus their own tail (0-8 blocks), short outputs (8-40 tokens), a KV capacity that binds (so
blocks are stored and evicted all the time), chunked prefill (budget 2048). The model is the
cached mock (no step clock), so a step's time is the engine's own work plus the mock's. With
events on, a subscriber (SUB socket, its own process) decodes every batch, so the publisher's
thread does its full work (hashing, encoding, sending) while the engine runs.

Run: .venv/bin/python benchmarks/kv_events_overhead.py [--repeats 7] [--requests 2000]
Prints, per step, the wall time and this process's CPU time (the engine, the publisher's thread
and ZeroMQ's I/O thread; not the subscriber's process) off and on, as the median and the
minimum over the runs (the minimum is the least disturbed by other work on the machine), and
their ratios (goal <= 1.2).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import platform
import random
import statistics
import tempfile
import time
from multiprocessing.queues import SimpleQueue
from multiprocessing.synchronize import Event as EventType

import msgspec
import zmq

from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.step import StepOutcome
from app.engine.types import Sequence
from app.kv_events.publisher import KVEventPublisher, KVEventsConfig
from app.kv_events.schema import MapEventsBatch
from app.models.cached_mock import CachedMockModel

SLOTS, BS = 256, 16


def workload(n: int, seed: int) -> list[Sequence]:
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 250) for _ in range(rng.randrange(8, 33) * BS)] for _ in range(16)]
    out = []
    for i in range(n):
        tail = [rng.randrange(1, 250) for _ in range(rng.randrange(0, 8 * BS + 1))]
        out.append(Sequence(f"r{i}", [*rng.choice(heads), *tail, 1], rng.randrange(8, 41),
                            frozenset({-1})))  # fmt: skip
    return out


class StepCounter:
    """The engine's observer here: counts steps."""

    steps = 0

    def on_step(self, outcome: StepOutcome) -> None:
        self.steps += 1

    def on_finished(self, seq: Sequence) -> None:
        pass


def drain(endpoint: str, stop: EventType, counts: SimpleQueue[int]) -> None:
    """A subscriber (its own process, as a router would be) that decodes every batch until
    stopped, then reports how many events it decoded."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(MapEventsBatch)  # the default encoding
    sub.recv_multipart()  # a probe: the subscriber has joined
    counts.put(-1)
    events = 0
    while not stop.is_set() or sub.poll(0):
        if sub.poll(20):
            _, _, payload = sub.recv_multipart()
            events += len(decoder.decode(payload).events)
    sub.close(linger=0)
    ctx.term()
    counts.put(events)


async def per_step_us(n: int, seed: int, events: bool) -> tuple[float, float, int, int, int]:
    config = EngineConfig(
        num_slots=SLOTS, max_waiting=n, max_num_batched_tokens=2048, block_size=BS,
        kv_cache_tokens=6000 * BS, max_model_len=1024, enable_prefix_caching=True,
        record_kv_events=events,
    )  # fmt: skip
    publisher = None
    ctx = multiprocessing.get_context("spawn")
    stop, counts = ctx.Event(), ctx.SimpleQueue()
    if events:
        folder = tempfile.mkdtemp()
        publisher = KVEventPublisher(KVEventsConfig(f"ipc://{folder}/kv", block_size=BS))
        subscriber = ctx.Process(target=drain, args=(publisher.endpoint, stop, counts))
        subscriber.start()
        while counts.empty():  # probes until the subscriber has joined (a SUB misses what
            publisher.publish([])  # is sent before it has)
            await asyncio.sleep(0.05)
        counts.get()
    counter = StepCounter()
    engine = Engine(CachedMockModel(SLOTS), config, observer=counter, kv_events=publisher)
    await engine.start()
    seqs = workload(n, seed)
    started, cpu = time.perf_counter(), time.process_time()
    streams = [engine.submit(seq) for seq in seqs]
    await engine.wait_idle()
    wall = time.perf_counter() - started
    if publisher is not None:  # its thread's work for these steps is part of their cost
        publisher.close(5.0)
    cpu = time.process_time() - cpu
    del streams
    await engine.stop()
    sent = decoded = 0
    if publisher is not None:
        sent = publisher.published
        stop.set()
        decoded = counts.get()
        subscriber.join()
    steps = counter.steps
    return wall / steps * 1e6, cpu / steps * 1e6, steps, sent, decoded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.repeats):  # interleaved, so drift hits both alike
        for events in (False, True):
            w, c, steps, sent, decoded = asyncio.run(per_step_us(args.requests, r, events))
            wall[events].append(w)
            cpu[events].append(c)
            print(f"run {r} events {'on ' if events else 'off'}: wall {w:6.0f} us/step, "
                  f"process CPU {c:6.0f} us/step ({steps} steps, {sent} batches sent, "
                  f"{decoded} events decoded)")  # fmt: skip
    print(f"{platform.python_implementation()} {platform.python_version()}, {SLOTS} slots, "
          f"{args.requests} requests x {args.repeats} runs; per step:")  # fmt: skip
    for name, figures in (("wall", wall), ("process CPU", cpu)):
        for stat, fn in (("median", statistics.median), ("min", min)):
            off, on = fn(figures[False]), fn(figures[True])
            print(f"  {name:12s} {stat:6s} off {off:6.0f} us, on {on:6.0f} us, "
                  f"ratio {on / off:.3f} (goal <= 1.2)")  # fmt: skip


if __name__ == "__main__":
    main()
