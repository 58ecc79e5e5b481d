"""The rank group: one engine per data-parallel rank (``--data-parallel-size``; one rank
without it), each with its own metrics and KV-event publisher, and the rank a request runs on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from app.config import Settings
from app.engine.core import EngineConfig
from app.engine.engine import Engine
from app.engine.errors import DuplicateRequestError
from app.engine.stream import RequestStream
from app.engine.types import FinishReason, Sequence
from app.metrics import EngineMetrics, ranked_registry
from app.models.protocol import Model

if TYPE_CHECKING:
    from app.kv_events.publisher import KVEventPublisher

CANCEL_TIMEOUT = 5.0  # seconds DELETE waits for the engine to apply an abort (one step, usually)


def kv_event_publisher(settings: Settings, rank: int = 0) -> KVEventPublisher | None:
    """The KV-event publisher ``--kv-events-endpoint`` asks for (None: off); its sockets are
    open on return (``KVEventsError`` if they cannot be)."""
    if settings.kv_events_endpoint is None:
        return None
    from app.kv_events.publisher import KVEventPublisher, KVEventsConfig

    prefixed = ("endpoint", "replay_endpoint", "topic", "buffer_steps", "int_hashes", "encoding",
                "max_replay_clients")  # fmt: skip
    config = KVEventsConfig(
        **{name: getattr(settings, f"kv_events_{name}") for name in prefixed},
        max_queue_size=settings.kv_events_queue_size,
        block_size=settings.block_size,
        hash_algo=settings.prefix_caching_hash_algo,
        hash_seed=settings.prefix_caching_hash_seed,
        host=settings.host,
    )
    return KVEventPublisher(config, rank)


class Ranks:
    """Per rank: its metrics (labelled ``engine=<rank>`` on /metrics with more than one rank),
    its KV-event publisher (open from the start) and its engine (``engines`` is empty until
    ``install``)."""

    def __init__(self, settings: Settings, sleep_level: Callable[[], int]) -> None:
        self.metrics = [
            EngineMetrics(
                settings.model_name, settings.num_slots, settings.profile, settings.max_model_len
            )
            for _ in range(settings.data_parallel_size)
        ]
        deprecated = settings.show_hidden_metrics_for_version is not None
        self.registry = ranked_registry(self.metrics, deprecated)
        self.events: list[KVEventPublisher | None] = []
        self.engines: list[Engine] = []
        try:
            for rank_metrics in self.metrics:
                rank_metrics.watch_sleep(sleep_level)  # vllm:engine_sleep_state
                publisher = kv_event_publisher(settings, len(self.events))
                self.events.append(publisher)
                if publisher is not None:
                    rank_metrics.watch_kv_events(publisher)
        except Exception:  # refused at start: no publisher thread is left behind
            self.close()
            raise

    def install(self, models: list[Model], config: EngineConfig) -> None:
        """One engine per rank, running ``models[rank]`` (not started yet)."""
        for model, metrics, events in zip(models, self.metrics, self.events, strict=True):
            engine = Engine(model, config, observer=metrics, kv_events=events)
            metrics.bind(engine.core)
            if config.max_loras is not None:  # LoRA on
                metrics.watch_loras(engine.core, config.max_loras)
            self.engines.append(engine)

    def close(self) -> None:
        """Close every KV-event publisher (a start refused)."""
        for publisher in self.events:
            if publisher is not None:
                publisher.close()

    async def stop(self, grace: float) -> None:
        """Drain every engine (``Engine.stop``), then close the publishers."""
        await asyncio.gather(*(engine.stop(grace) for engine in self.engines))
        await asyncio.to_thread(self.close)

    def submit(self, seq: Sequence, rank: int | None) -> tuple[int, RequestStream]:
        """Queue ``seq`` on rank ``rank`` (None: the least loaded: fewest live requests, ties
        the lowest rank; ``rank`` must be in range: the API checks the header); the rank and
        the stream. ``Engine.submit``'s refusals, and ``DuplicateRequestError`` for an id live
        on another rank."""
        engines = self.engines
        if rank is None:
            rank = min(range(len(engines)), key=lambda r: len(engines[r].core.live))
        if any(seq.request_id in e.core.live for r, e in enumerate(engines) if r != rank):
            raise DuplicateRequestError(f"request id {seq.request_id!r} is already in use")
        return rank, engines[rank].submit(seq)

    def rank_of(self, request_id: str) -> int | None:
        """The rank whose engine holds the live request ``request_id``."""
        return next((r for r, e in enumerate(self.engines) if request_id in e.core.live), None)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a live request early with ``reason`` (``Engine.abort``); False if none has
        this id."""
        rank = self.rank_of(request_id)
        return rank is not None and self.engines[rank].abort(request_id, reason)

    async def cancel(self, request_id: str, owner: str | None = None) -> bool:
        """Abort a live request and wait (at most ``CANCEL_TIMEOUT``) until the engine has
        applied it, so its id is free again on return. False if no live request has this id,
        or (``owner``: an API key's name) none of that key's: another key's request is left
        alone, as if it did not exist."""

        def mine(stream: RequestStream) -> bool:
            return owner is None or stream.seq.user == owner

        rank = self.rank_of(request_id)
        stream = None if rank is None else self.engines[rank].core.live.get(request_id)
        own = stream is not None and mine(stream)
        streams = [stream] if stream is not None and own and self.abort(request_id) else []
        siblings = f"{request_id}~"  # the other choices (n > 1, several prompts): <id>~<k>,
        for engine in self.engines:  # live even when the first one has ended
            for sibling_id, sibling in list(engine.core.live.items()):
                if sibling_id.startswith(siblings) and mine(sibling) and self.abort(sibling_id):
                    streams.append(sibling)
        if not streams:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(s.ended() for s in streams)), CANCEL_TIMEOUT)
        return True

    @property
    def down(self) -> str | None:
        """``draining`` or ``engine_dead`` if any engine is; None if all serve."""
        if any(engine.draining for engine in self.engines):
            return "draining"
        return None if all(engine.alive for engine in self.engines) else "engine_dead"

    @property
    def no_slot(self) -> bool:
        """Whether every slot of every rank is out of service (no model call resets them)."""
        tables = [engine.core.scheduler.slots for engine in self.engines]
        return all(len(t.out_of_service) == t.capacity for t in tables)

    def slots(self, rank: int, viewer: str | None) -> list[dict[str, object]]:
        """Rank ``rank``'s slot table now, one entry per slot (like llama.cpp's ``/slots``).
        ``viewer``: the API key's name asking (None: no keys, every entry whole); another
        key's request shows without its ``request_id`` and ``user``."""
        scheduler, now = self.engines[rank].core.scheduler, time.monotonic()
        table, scheduling = scheduler.slots, scheduler.policy
        out_of_service = table.out_of_service
        out: list[dict[str, object]] = []
        for index in range(table.capacity):
            seq = table.get(index)
            entry: dict[str, object] = {"id": index, "is_processing": seq is not None}
            if index in out_of_service:
                entry["out_of_service"] = True
            if seq is not None:
                level = scheduling.level(seq) if scheduling is not None else None
                entry |= {
                    "request_id": seq.request_id,
                    "prompt_tokens": seq.prompt_len,
                    "n_decoded": seq.num_generated,
                    "max_tokens": seq.max_tokens,
                    "n_remain": seq.max_tokens - seq.num_generated,
                    "n_computed": seq.num_computed_tokens,
                    "prefilling": seq.prefilling,
                    "priority": seq.priority,
                    "user": seq.user,
                    "preemptions": seq.num_preemptions,
                    "age_seconds": round(now - seq.times.arrival, 6),
                }
                if level is not None:
                    entry["level"] = level
                if viewer is not None and seq.user != viewer:
                    del entry["request_id"], entry["user"]
            out.append(entry)
        return out
