"""The engine's KV-event sink: a ZeroMQ PUB socket (and a ROUTER socket for replays) served by
one background thread, fed through a bounded queue, so the engine never waits on a subscriber.

Wire protocol (vLLM's ``ZmqEventPublisher``):

- PUB: each batch is a 3-frame message ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian
  sequence number, one per batch, and ``payload`` the msgpack ``KVEventBatch``.
- Replay (ROUTER): a client sends ``(b"", start_seq)`` (a REQ socket adds the empty frame; a
  DEALER sends it) and receives, for every buffered batch with ``seq >= start_seq``, the frames
  ``(b"", seq, payload)``, then an end marker ``(b"", -1 as 8 signed bytes, b"")``. The buffer
  keeps the last ``buffer_steps`` batches.

The engine numbers each batch when the queue takes it. A step whose batch finds the queue full
keeps its events, merged into the next step's batch (or sent by the thread once the queue has
drained): delayed, not lost, and the sequence stays gap-free. Only past ``max_pending_events``
waiting events are they dropped: their batch's number is skipped (a gap subscribers see by
sequence number) and ``dropped`` counts it. A PUB socket itself drops messages for a subscriber
past its high-water mark, which is also a gap the replay covers.

Replays never starve publishing: the thread answers them a chunk per loop turn, the queue sent
in between (app/kv_events/replay.py, which also bounds what unread answers may hold).

Where the sockets listen: a ``*`` host binds where the HTTP server listens (``host``, i.e.
``--host``: 127.0.0.1 by default; a wildcard ``--host`` such as 0.0.0.0 keeps ``*``, every
interface); ``tcp://0.0.0.0:P`` (or ``[::]``) binds every interface whatever ``--host`` is.
Any other host is connected to by the PUB socket (vLLM's rule) and bound by the replay
socket. A socket bound beyond loopback is logged as a warning at start: events carry prompt
token ids, so a prompt can be read back from ``BlockStored``.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq

from app.engine.prefix_cache import CacheEvent, CacheEventKind
from app.kv_events.hashing import BlockHasher, HashAlgo, external
from app.kv_events.replay import ReplayServer
from app.kv_events.schema import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    MapAllBlocksCleared,
    MapBlockRemoved,
    MapBlockStored,
    MapEventsBatch,
    MapKVEventBatch,
)

Encoding = Literal["array", "map", "map-batch"]
STRUCTS: dict[str, tuple[Any, Any, Any, Any]] = {  # batch, stored, removed, cleared
    "array": (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared),
    "map": (MapEventsBatch, MapBlockStored, MapBlockRemoved, MapAllBlocksCleared),
    "map-batch": (MapKVEventBatch, MapBlockStored, MapBlockRemoved, MapAllBlocksCleared),
}

log = logging.getLogger("slotserve.kv_events")

ENDPOINT = re.compile(
    r"^(tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.:-]+):\d{1,5}|ipc://.+|inproc://.+)$"
)
POLL_SECONDS = 0.05  # the thread's wake-up period while idle (serves replays meanwhile)
# Once a batch arrives, the thread waits this long for more and sends them all in one go: one
# wake-up (and one hand-over of the GIL by the engine) per period instead of one per step.
COALESCE_SECONDS = 0.005
WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::", "")  # bind every interface
LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|localhost|\[::1\])$")


class KVEventsError(Exception):
    """The endpoints cannot be used (a malformed address, a port in use): refused at start."""


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is a ZeroMQ address vLLM's publisher takes (tcp://HOST:PORT,
    ipc://PATH, inproc://NAME), else ValueError."""
    if not ENDPOINT.match(endpoint) or (
        endpoint.startswith("tcp://") and not 1 <= int(endpoint.rsplit(":", 1)[1]) <= 65535
    ):
        raise ValueError(
            f"{endpoint!r} is not a ZeroMQ endpoint (tcp://*:5557, tcp://HOST:PORT, ipc://PATH "
            "or inproc://NAME)"
        )
    return endpoint


def _tcp_host(endpoint: str) -> str | None:
    return endpoint[len("tcp://") :].rsplit(":", 1)[0] if endpoint.startswith("tcp://") else None


def binds(endpoint: str) -> bool:
    """Whether a PUB socket binds ``endpoint`` (vLLM's rule: a wildcard, ipc or inproc
    address; here ``0.0.0.0`` counts as a wildcard too) rather than connecting to it."""
    return (
        _tcp_host(endpoint) in WILDCARD_HOSTS
        or "::" in endpoint
        or not endpoint.startswith("tcp://")
    )


def bound_endpoint(endpoint: str, host: str | None) -> str:
    """The address a bound ``endpoint`` listens on: a ``*`` host becomes ``host`` (the HTTP
    server's ``--host``), unless that is a wildcard too or None (then ``*`` stays)."""
    if _tcp_host(endpoint) != "*" or host is None or host in WILDCARD_HOSTS:
        return endpoint
    shown = f"[{host}]" if ":" in host else host
    return f"tcp://{shown}:{endpoint.rsplit(':', 1)[1]}"


def beyond_loopback(endpoint: str) -> bool:
    """Whether a socket bound on ``endpoint`` can be reached from another machine."""
    host = _tcp_host(endpoint)
    return host is not None and not LOOPBACK.match(host)


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """vLLM's rule for data-parallel rank ``rank``: tcp ports are offset by the rank, inproc
    and ipc names get a ``_dp<rank>`` suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields that apply here, plus the hashing scheme."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 10_000
    max_pending_events: int = 100_000  # events held back for a full queue, past it dropped
    max_replay_clients: int = 8  # clients holding unread replay answers at once (replay.py)
    host: str | None = None  # what a ``*`` host binds (the HTTP server's; None: every interface)
    block_size: int = 16
    hash_algo: HashAlgo = "sha256"
    hash_seed: str = "0"
    int_hashes: bool = True
    encoding: Encoding = "map"  # vLLM 0.24+'s map events (see app/kv_events/schema.py)


def _bind_or_connect(socket: zmq.Socket[bytes], endpoint: str, host: str | None) -> str:
    """Bind (``binds``) or connect ``socket``; returns the address used."""
    if not binds(endpoint):
        socket.connect(endpoint)
        return endpoint
    address = bound_endpoint(endpoint, host)
    if "[" in address:
        socket.setsockopt(zmq.IPV6, 1)
    socket.bind(address)
    return address


class KVEventPublisher:
    """Publishes the prefix cache's changes, one ``KVEventBatch`` per engine step.

    ``publish`` is called on the engine's thread and only enqueues (O(events), no hashing, no
    encoding, no I/O); the thread hashes, encodes, sends and answers replays. Construction
    binds the sockets (``KVEventsError`` if it cannot); ``close`` stops the thread."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        replay = config.replay_endpoint
        self.replay_endpoint = None if replay is None else offset_endpoint_port(replay, self.rank)
        if self.replay_endpoint is not None:
            self.replay_endpoint = bound_endpoint(self.replay_endpoint, config.host)
        self.dropped = 0  # batches dropped past ``max_pending_events`` (a gap in ``seq``)
        self.published = 0  # batches sent on the PUB socket
        self.errors = 0  # batches the thread failed to send (logged)
        self._next_seq = 0
        self._pending: list[CacheEvent] = []  # events a full queue refused, sent with the next
        self._lock = threading.Lock()  # the engine's publish vs the thread's flush of _pending
        self._queue: queue.Queue[tuple[int, float, list[CacheEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._hasher = BlockHasher(config.hash_algo, config.hash_seed)
        self._encoder = msgspec.msgpack.Encoder()
        self._structs = STRUCTS[config.encoding]
        self._extra_keys = config.encoding != "array"  # (the array layout predates them)
        self._topic = config.topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub, self._replay = self._open_sockets()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slotserve-kv-events", daemon=True)
        self._thread.start()

    def _open_sockets(self) -> tuple[zmq.Socket[bytes], ReplayServer | None]:
        """The PUB socket (bound or connected) and the replay server, if any; ``KVEventsError``
        if either cannot be opened (nothing left open then). Warns of a socket bound beyond
        loopback (see the module's docstring)."""
        pub = self._ctx.socket(zmq.PUB)
        replay: ReplayServer | None = None
        try:
            pub.set_hwm(self.config.hwm)
            self.endpoint = _bind_or_connect(pub, self.endpoint, self.config.host)
            if self.replay_endpoint is not None:
                replay = ReplayServer(
                    self._ctx, self.replay_endpoint, self.config.max_replay_clients
                )
        except zmq.ZMQError as err:
            pub.close(linger=0)
            self._ctx.term()
            where = self.endpoint if replay is None else f"{self.endpoint} / {self.replay_endpoint}"
            raise KVEventsError(f"KV events: cannot open {where}: {err}") from None
        listening = [e for e in (self.endpoint, self.replay_endpoint)
                     if e is not None and (e == self.replay_endpoint or binds(e))
                     and beyond_loopback(e)]  # fmt: skip
        for endpoint in listening:
            log.warning(
                "KV events: %s listens beyond loopback; events carry prompt token ids (a "
                "prompt can be read from BlockStored): keep it on a trusted network",
                endpoint,
            )
        return pub, replay

    # --- the engine's side ------------------------------------------------------------------

    def publish(self, events: list[CacheEvent]) -> None:
        """Hand one step's events over (never blocks). A full queue keeps them for the next
        batch; past ``max_pending_events`` they are dropped, their number skipped, counted."""
        with self._lock:
            if self._pending:
                self._pending.extend(events)
                events = self._pending
            try:
                self._queue.put_nowait((self._next_seq, time.time(), events))
            except queue.Full:
                if events is not self._pending:
                    self._pending = list(events)
                if len(self._pending) > self.config.max_pending_events:
                    self._pending = []
                    self._next_seq += 1
                    self.dropped += 1
                return
            self._pending = []
            self._next_seq += 1

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the sockets."""
        self._stopping.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ctx.term()

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = False
                if self._replay is not None:
                    try:
                        self._replay.serve(self._buffer)
                        busy = self._replay.busy
                    except zmq.ZMQError:  # one client's trouble: logged, the thread goes on
                        log.exception("KV events: a replay request failed")
                try:
                    item = self._queue.get(timeout=0 if busy else self._idle_seconds())
                except queue.Empty:
                    self._flush_pending()
                    if self._stopping.is_set() and not self._pending:
                        return
                    continue
                if not self._stopping.is_set():
                    time.sleep(COALESCE_SECONDS)
                while item is not None:
                    self._send(*item)
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        item = None
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close()

    def _idle_seconds(self) -> float:
        """How long the thread may wait for a batch: shorter while replays wait for clients
        to read (so they go on soon after)."""
        paused = self._replay is not None and self._replay.waiting
        return COALESCE_SECONDS if paused else POLL_SECONDS

    def _flush_pending(self) -> None:
        """The queue is empty: send the events a full queue held back, numbered now (the
        engine cannot queue meanwhile, so the numbers stay in order)."""
        with self._lock:
            if not self._pending or not self._queue.empty():
                return
            events, self._pending = self._pending, []
            seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._send(seq, time.time(), events)

    def _send(self, seq: int, ts: float, events: list[CacheEvent]) -> None:
        try:
            batch = self._structs[0](ts, [self._event(e) for e in events], self.rank)
            payload = self._encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception:
            if not self.errors:
                log.exception("KV events: a batch could not be sent (logged once)")
            self.errors += 1
            return
        self._buffer.append((seq, payload))
        self.published += 1

    def _event(self, event: CacheEvent) -> Any:
        as_int, digest = self.config.int_hashes, self._hasher.digest
        _, stored, removed, cleared = self._structs
        if event.kind is CacheEventKind.STORED:
            first = event.blocks[0]
            parent = None if first.parent is None else external(digest(first.parent), as_int)
            tokens = [t for block in event.blocks for t in block.tokens]
            hashes = [external(digest(block), as_int) for block in event.blocks]
            args = (hashes, parent, tokens, self.config.block_size, None, MEDIUM_GPU, first.lora)
            if self._extra_keys:  # vLLM's per-block extra keys: the adapter's name, if any
                extra = None if first.lora is None else (first.lora,)
                return stored(*args, extra_keys=[extra] * len(hashes))
            return stored(*args)
        if event.kind is CacheEventKind.REMOVED:
            return removed([external(digest(b), as_int) for b in event.blocks], MEDIUM_GPU)
        return cleared()
