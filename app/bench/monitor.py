"""The server's side of a run: slot occupancy and queue length over time, and its counters.

``Monitor`` polls ``/slots`` (slotserve: running, waiting, slots) or ``/metrics`` (any server
with vLLM's metric names: ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``) every
``interval`` seconds while the run goes on. ``read_metric`` reads one Prometheus sample, e.g.
``vllm:generation_tokens_total`` before and after a run to check the tool's token count.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Literal

import httpx

Source = Literal["slots", "metrics"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One poll: ``time.monotonic()``, requests running and waiting, slots (if known)."""

    at: float
    running: float
    waiting: float
    slots: float | None


def parse_prometheus(text: str, names: set[str]) -> dict[str, float]:
    """The sum of the samples of each metric in ``names`` (over all label sets) in
    Prometheus text format; metrics absent from the text are absent from the result."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        name = line[:end] if end >= 0 else line
        if name in names:
            value = line.rsplit(" ", 1)[-1]
            with contextlib.suppress(ValueError):
                found[name] = found.get(name, 0.0) + float(value)
    return found


async def read_metric(client: httpx.AsyncClient, name: str) -> float | None:
    """One metric's value from ``/metrics`` (summed over labels); None if the server has no
    such metric or no ``/metrics``."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_prometheus(response.text, {name}).get(name)


@dataclass
class Monitor:
    """Polls the server until ``stop()``; ``samples`` holds what it saw. A source that fails
    (404, not JSON, unreachable) ends the polling quietly: the run does not depend on it."""

    client: httpx.AsyncClient
    source: Source
    interval: float = 0.25
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        while True:
            try:
                self.samples.append(await self._sample())
            except (httpx.HTTPError, ValueError, KeyError) as err:
                self.error = f"monitoring /{self.source} stopped: {err}"
                return
            await asyncio.sleep(self.interval)

    async def _sample(self) -> Sample:
        response = await self.client.get("/" + self.source)
        response.raise_for_status()
        now = time.monotonic()
        if self.source == "slots":
            body = response.json()
            return Sample(now, body["running"], body["waiting"], body["num_slots"])
        names = {"vllm:num_requests_running", "vllm:num_requests_waiting"}
        values = parse_prometheus(response.text, names)
        if not values:
            raise ValueError("no vllm:num_requests_* metrics")
        return Sample(
            now,
            values.get("vllm:num_requests_running", math.nan),
            values.get("vllm:num_requests_waiting", math.nan),
            None,
        )
