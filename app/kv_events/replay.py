"""The KV-event replay socket (vLLM's ROUTER protocol), with bounded memory per client and in all.

A client sends ``(b"", start_seq)`` and gets ``(b"", seq, payload)`` for every buffered batch
from ``start_seq`` on, up to the last batch buffered when it asked, then ``(b"", -1, b"")``.

What bounds memory: ZeroMQ queues what a ROUTER sends to a peer in that peer's pipe, copied,
until the peer reads it; with vLLM's settings a client that asks from 0 and never reads pins a
copy of the whole buffer (31 MB for 10,000 batches of a busy server), and any number of them
may. Here the socket has ``ROUTER_MANDATORY`` and a send high-water mark of ``CLIENT_HWM``
messages per peer, and sends without blocking: a peer whose pipe is full raises ``EAGAIN``, its
replay pauses (others go on), and a peer that takes nothing for ``STALL_SECONDS`` is dropped
(its replay forgotten: it never gets the end marker; a real client times out and asks again).
A dropped peer still holds its full pipe while it stays connected, and ZeroMQ offers no way
to close one peer, so at most ``max_clients`` peers may hold replay data (being answered or
dropped); a new client past that resets the socket when dropped peers hold memory (every
connection closed, every pipe freed; clients reconnect by themselves and ask again), and is
ignored otherwise (every slot belongs to a reader: it asks again after its timeout). Memory is
thus at most ``max_clients x CLIENT_HWM`` batches, and returns to ZeroMQ when clients leave.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass

import zmq

log = logging.getLogger("slotserve.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
CHUNK = 500  # batches sent per turn of the publisher's thread, over every client
CLIENT_HWM = 100  # batches queued for one client before its replay pauses
STALL_SECONDS = 2.0  # a client that takes nothing this long is dropped
REBIND_SECONDS = 2.0  # how long a reset retries the bind (the old listener closes async)


@dataclass(slots=True)
class _Replay:
    next_seq: int
    last_seq: int
    stalled_since: float | None = None  # when its pipe was found full (None: flowing)


class ReplayServer:
    """Answers replay requests on ``endpoint`` (a bound ROUTER socket) from the publisher's
    thread: ``serve`` once per turn. ``dropped`` counts clients dropped for not reading,
    ``refused`` requests ignored at the client bound, ``resets`` socket resets."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, max_clients: int):
        self.ctx, self.endpoint, self.max_clients = ctx, endpoint, max_clients
        self.dropped = self.refused = self.resets = 0
        self._active: dict[bytes, _Replay] = {}
        self._stalled: set[bytes] = set()  # dropped clients whose pipes may still be full
        self.socket = self._open()

    def _open(self) -> zmq.Socket[bytes]:
        socket = self.ctx.socket(zmq.ROUTER)
        try:
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            socket.set_hwm(CLIENT_HWM)
            if "[" in self.endpoint:
                socket.setsockopt(zmq.IPV6, 1)
            socket.bind(self.endpoint)
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        return socket

    @property
    def busy(self) -> bool:
        """Whether a replay can go on at once (the thread should not sleep)."""
        return any(r.stalled_since is None for r in self._active.values())

    @property
    def waiting(self) -> bool:
        """Whether a replay waits for its client to read (the thread should look again soon)."""
        return bool(self._active)

    def close(self) -> None:
        self.socket.close(linger=0)

    def serve(self, buffer: deque[tuple[int, bytes]]) -> None:
        """Take the waiting requests, then send up to ``CHUNK`` batches over the replays."""
        while self.socket.poll(0):
            self._request(self.socket.recv_multipart(), buffer)
        budget = CHUNK
        for client in list(self._active):
            if budget <= 0:
                break
            budget -= self._answer(client, buffer, budget)

    def _request(self, frames: list[bytes], buffer: deque[tuple[int, bytes]]) -> None:
        if len(frames) != 3 or len(frames[2]) > 8:
            log.warning("KV events: a malformed replay request ignored")
            return
        client, _, start = frames
        self._stalled.discard(client)  # asking again, it counts among the active below
        if client not in self._active and len(self._active) + len(self._stalled) >= (
            self.max_clients
        ):
            if self._stalled:
                self._reset()  # (this request goes too: the client asks again)
            else:
                self.refused += 1
            return
        last = buffer[-1][0] if buffer else -1
        self._active[client] = _Replay(int.from_bytes(start, "big"), last)

    def _answer(self, client: bytes, buffer: deque[tuple[int, bytes]], budget: int) -> int:
        """Send ``client`` up to ``budget`` batches (then its end marker once all are sent);
        returns how many were sent. A full pipe pauses it, or drops it past the stall time;
        a client that has left is forgotten."""
        replay = self._active[client]
        start = bisect.bisect_left(buffer, replay.next_seq, key=lambda item: item[0])
        sent = 0
        try:
            for index in range(start, len(buffer)):
                seq, payload = buffer[index]
                if seq > replay.last_seq:
                    break
                if sent == budget:
                    return sent
                self._send(client, seq.to_bytes(8, "big"), payload)
                replay.next_seq, replay.stalled_since, sent = seq + 1, None, sent + 1
            self._send(client, END_SEQ, b"")
            del self._active[client]
        except zmq.Again:  # its pipe is full: it is not reading (yet)
            now = time.monotonic()
            if replay.stalled_since is None:
                replay.stalled_since = now
            elif now - replay.stalled_since > STALL_SECONDS:
                del self._active[client]
                self._stalled.add(client)
                self.dropped += 1
                log.warning("KV events: a replay client that read nothing for %.0f s dropped",
                            STALL_SECONDS)  # fmt: skip
        except zmq.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            self._active.pop(client, None)  # it has left
        return sent

    def _send(self, client: bytes, seq: bytes, payload: bytes) -> None:
        self.socket.send_multipart((client, b"", seq, payload), flags=zmq.NOBLOCK)

    def _reset(self) -> None:
        """Close the socket (every connection and queued answer with it) and bind again."""
        self.socket.close(linger=0)
        self._active.clear()
        self._stalled.clear()
        self.resets += 1
        deadline = time.monotonic() + REBIND_SECONDS
        while True:
            try:
                self.socket = self._open()
                break
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)  # the old listener is still closing in ZeroMQ's I/O thread
        log.warning("KV events: %d replay clients held unread answers: replay socket reset",
                    self.max_clients)  # fmt: skip
