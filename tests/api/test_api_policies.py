"""Scheduling policies over HTTP: the ignored-priority header, /slots, preemption counted in the
metrics, --max-priority-for, and a real server that lets a better priority overtake."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from conftest import ClientFactory, serving_of
from error_shape import field_of
from pydantic import ValidationError
from reference import run_alone
from server_process import running_server
from sse import parse_sse

from app.config import Settings
from app.models.mock import MockModel
from app.models.mock_language import MockLanguage
from app.serving import GenerationParams, InvalidRequestError, Serving

HEADER = "x-slotserve-priority-ignored"
ROUTES = [
    ("/generate", {"prompt": "hi ", "max_tokens": 3}),
    ("/v1/completions", {"prompt": "hi ", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("route", "body"), ROUTES, ids=[r for r, _ in ROUTES])
async def test_fcfs_reports_a_non_default_priority_as_ignored(
    make_client: ClientFactory, route: str, body: dict[str, object], stream: bool
) -> None:
    async with make_client() as client:
        ignored = await client.post(route, json=body | {"priority": -5, "stream": stream})
        default = await client.post(route, json=body | {"stream": stream})
    assert ignored.status_code == default.status_code == 200
    assert ignored.headers.get(HEADER) == "1" and HEADER not in default.headers


@pytest.mark.parametrize(("route", "body"), ROUTES, ids=[r for r, _ in ROUTES])
async def test_the_priority_policy_honours_priority_without_the_header(
    make_client: ClientFactory, route: str, body: dict[str, object]
) -> None:
    async with make_client(policy="priority") as client:
        r = await client.post(route, json=body | {"priority": -5, "stream": False})
    assert r.status_code == 200 and HEADER not in r.headers


@pytest.mark.parametrize(("route", "body"), ROUTES, ids=[r for r, _ in ROUTES])
async def test_priority_outside_its_range_is_a_400(
    make_client: ClientFactory, route: str, body: dict[str, object]
) -> None:
    async with make_client(policy="priority") as client:
        r = await client.post(route, json=body | {"priority": 1001})
    assert r.status_code == 400 and field_of(r.json()["error"]) == "priority"


async def until(predicate: object, timeout: float = 5.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_slots_show_priority_user_level_and_preemptions(make_client: ClientFactory) -> None:
    async with make_client(policy="mlfq", num_slots=2, mock_step_ms=5) as client:
        body = {"prompt": "hi ", "max_tokens": 2000, "ignore_eos": True, "priority": 7,
                "user": "alice", "request_id": "r1"}  # fmt: skip
        task = asyncio.create_task(client.post("/generate", json=body))

        async def running() -> bool:
            slots = (await client.get("/slots")).json()["slots"]
            return any(s.get("request_id") == "r1" for s in slots)

        await until(running)
        (slot,) = [s for s in (await client.get("/slots")).json()["slots"] if s["is_processing"]]
        assert slot["priority"] == 7 and slot["user"] == "alice"
        assert slot["level"] == 0 and slot["preemptions"] == 0
        await client.delete("/requests/r1")
        await task


async def test_a_better_priority_preempts_and_the_preempted_request_loses_nothing(
    make_client: ClientFactory,
) -> None:
    language = MockLanguage(seed=3, stop_probability=0.0)
    async with make_client(
        MockModel(language), policy="priority", num_slots=1, mock_step_ms=2
    ) as client:
        serving = serving_of(client)
        low = {"prompt": "slow ", "max_tokens": 60, "priority": 5, "request_id": "low"}
        low_task = asyncio.create_task(client.post("/generate", json=low))

        async def low_running() -> bool:
            return serving.engine.core.num_running == 1

        await until(low_running)
        high = await client.post(
            "/generate", json={"prompt": "fast ", "max_tokens": 5, "priority": -5}
        )
        assert not low_task.done()  # the better priority finished first
        low_events = parse_sse((await low_task).text)
        metrics = (await client.get("/metrics")).text
    assert parse_sse(high.text)[-1].data["finish_reason"] == "length"
    done = low_events[-1].data
    prompt = list(b"slow ")
    assert done["tokens"] == run_alone(MockModel(language), prompt, 60, 256, False)
    assert [t for e in low_events[:-1] for t in e.data["tokens"]] == done["tokens"]
    assert 'vllm:num_preemptions_total{engine="0",model_name="slotserve-mock"} 1.0' in metrics


def test_max_priority_for_bounds_the_priority_a_named_key_may_claim() -> None:
    serving = Serving(Settings(policy="priority", max_priority_for="batch=10, ops=-100"))
    with pytest.raises(InvalidRequestError) as err:
        serving.prepare(GenerationParams([1, 2], 4, priority=9, key_name="batch"))
    assert err.value.param == "priority" and err.value.code == "priority_not_allowed"
    assert serving.prepare(GenerationParams([1, 2], 4, priority=10, key_name="batch"))
    assert serving.prepare(GenerationParams([1, 2], 4, priority=-100, key_name="ops"))
    assert serving.prepare(GenerationParams([1, 2], 4, priority=-1000))  # no named key: no bound
    seq = serving.prepare(GenerationParams([1, 2], 4, user="claimed", key_name="batch"))
    assert seq.priority == 10  # the default priority is the key's bound
    assert seq.user == "batch"  # the key's name is the user; the client cannot override it


@pytest.mark.parametrize("value", ["batch", "batch=x", "=3", "batch=1001"])
def test_a_malformed_max_priority_for_is_refused_at_start(value: str) -> None:
    with pytest.raises(ValidationError, match="KEY=LEVEL"):
        Settings(max_priority_for=value)


def test_a_real_server_serves_a_better_priority_first_when_every_slot_is_busy() -> None:
    flags = ("--policy", "priority", "--num-slots", "2", "--mock-step-ms", "3")
    with running_server(*flags) as server, httpx.Client(base_url=server.url) as client:
        long = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": False,
                "priority": 10}  # fmt: skip
        with httpx.Client(base_url=server.url, timeout=30) as other:
            results: list[float] = []

            def run_long() -> None:
                other.post("/generate", json=long)
                results.append(time.monotonic())

            threads = [threading.Thread(target=run_long) for _ in range(2)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 10
            while client.get("/slots").json()["running"] < 2:
                assert time.monotonic() < deadline
            urgent = client.post("/generate", json={"prompt": "y", "max_tokens": 5,
                                                     "priority": -1, "stream": False})  # fmt: skip
            urgent_done = time.monotonic()
            for thread in threads:
                thread.join(30)
        metrics = client.get("/metrics").text
    assert urgent.status_code == 200 and urgent.json()["finish_reason"] == "length"
    assert all(urgent_done < t for t in results)  # it did not wait for a long one to end
    assert 'vllm:num_preemptions_total{engine="0",model_name="slotserve-mock"} 1.0' in metrics
