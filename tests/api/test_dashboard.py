"""``/dashboard``: the live slot view, its event stream and the page in a real browser."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import CHROMIUM, open_page
from server_process import running_server

from app.api.dashboard import MAX_WATCHERS, DashboardFeed
from app.config import Settings
from app.serving import Serving

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary (.ci/run and make test install Debian's chromium)"
)


def first_frame(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    with httpx.stream("GET", f"{url}/dashboard/events", headers=headers, timeout=10) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                frame: dict[str, Any] = json.loads(line.removeprefix("data:"))
                return frame
    raise AssertionError("no frame")


@pytest.fixture
def busy_server() -> Iterator[str]:
    """A server with more requests than slots, kept busy until the test ends."""
    with running_server("--num-slots", "6", "--mock-step-ms", "10", "--api-key", "alice-key",
                        "--max-num-batched-tokens", "32") as server:  # fmt: skip
        stop = threading.Event()

        def load(worker: int) -> None:
            headers = {"Authorization": "Bearer alice-key"}
            with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
                for i in range(200):
                    if stop.is_set():
                        return
                    body = {
                        "prompt": "secret prompt " * (1 + i % 5),
                        "max_tokens": 5 + (worker * 13 + i * 7) % 40,
                        "request_id": f"private-{worker}-{i}",
                    }
                    client.post("/generate", json=body)

        threads = [threading.Thread(target=load, args=(w,)) for w in range(10)]
        for thread in threads:
            thread.start()
        try:
            yield server.url
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)


def test_frames_show_the_slots_without_ids_text_or_keys(busy_server: str) -> None:
    page = httpx.get(f"{busy_server}/dashboard")  # open without a key, like /metrics
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "http://" not in page.text and "https://" not in page.text  # no external assets
    frame = first_frame(busy_server)
    while not any(frame["ranks"][0]["slots"]):
        frame = first_frame(busy_server)
    rank = frame["ranks"][0]
    assert len(rank["slots"]) == 6 and 0 <= rank["kv_usage"] <= 1
    hue, decoding, generated, max_tokens, preemptions = next(c for c in rank["slots"] if c)
    assert 0 <= hue < 360 and decoding in (0, 1) and 0 <= generated <= max_tokens
    assert preemptions >= 0
    text = json.dumps(frame)
    assert "private-" not in text and "secret" not in text and "alice" not in text


async def test_nobody_watching_costs_nothing_and_watchers_share_frames() -> None:
    serving = Serving(Settings(num_slots=2))
    feed = DashboardFeed(serving, hz=200.0)
    first, second = feed.frames(), feed.frames()
    frames = await asyncio.gather(anext(first), anext(second))
    assert frames[0] is frames[1]  # one encoding for every watcher
    assert feed.watchers == 2 and feed._task is not None
    await first.aclose()
    assert feed._task is not None  # one watcher left
    await second.aclose()
    assert feed.watchers == 0 and feed._task is None  # the producer stopped with the last


async def test_watchers_past_the_bound_get_503(busy_server: str) -> None:
    async with httpx.AsyncClient(base_url=busy_server, timeout=10) as client:
        streams = []
        for _ in range(MAX_WATCHERS):
            request = client.build_request("GET", "/dashboard/events")
            streams.append(await client.send(request, stream=True))
        readers = [stream.aiter_lines() for stream in streams]  # kept: a dropped one closes
        for lines in readers:  # each has its first frame: all are counted as watching
            while not (await anext(lines)).startswith("data:"):
                pass
        refused = await client.send(client.build_request("GET", "/dashboard/events"), stream=True)
        assert refused.status_code == 503  # (checked before reading: a 200 streams forever)
        await refused.aread()
        assert refused.headers["x-slotserve-error-code"] == "too_many_watchers"
        for stream in streams:
            await stream.aclose()


@needs_chromium
def test_the_page_draws_changing_lanes_in_chromium_without_script_errors(
    busy_server: str,
) -> None:
    with open_page(f"{busy_server}/dashboard") as page:
        deadline = time.monotonic() + 30
        while (page.evaluate("window.dashboard.laneChanges") or 0) < 3:
            assert time.monotonic() < deadline, "the lanes did not change"
            time.sleep(0.1)
        state = page.evaluate("JSON.stringify(window.dashboard)")
        drawn = page.evaluate("document.getElementById('lanes').height")
        busy = page.evaluate("document.getElementById('running').textContent")
    body = json.loads(state)
    assert body["errors"] == [] and page.exceptions == []
    assert body["frames"] >= 3 and drawn > 0 and busy.endswith("/ 6")


def test_a_drain_ends_every_dashboard_stream_with_a_last_frame(tmp_path: Path) -> None:
    """SIGTERM: the open streams get a last frame saying ``draining`` and end cleanly, so the
    shutdown never waits on a dashboard (nor logs an error about one)."""
    log = tmp_path / "server.log"
    with log.open("wb") as sink, running_server("--log-level", "info", stderr=sink) as server:
        frames: list[dict[str, Any]] = []
        with httpx.stream("GET", f"{server.url}/dashboard/events", timeout=10) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    frames.append(json.loads(line.removeprefix("data:")))
                    if len(frames) == 1:
                        server.terminate()
        assert frames[-1]["state"] == "draining" and len(frames) >= 2
        assert server.wait_exit(timeout=30) in (0, -15)  # uvicorn re-raises the SIGTERM it took
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text
