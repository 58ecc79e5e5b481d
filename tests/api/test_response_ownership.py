"""Stored responses belong to the API key that made them (issue 27, findings 3 and 4): another
key's response answers as if it did not exist (GET, ``previous_response_id``, cancel,
``DELETE /requests``), ``/slots`` shows another key's request without its id, and what a
stored response may hold is bounded (``metadata`` at OpenAI's limits, the store in bytes).
End to end against a real server with the openai SDK, as users run it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import ClientFactory
from server_process import ServerProcess, running_server, wait_until

from app.api.adapters.responses_store import ResponseStore, Stored

MODEL = "slotserve-mock"
ALICE, BOB = "sk-alice", "sk-bob"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """Keys alice and bob; 10 ms steps and replies that only end at their max tokens, so a
    background response is still running while the other key tries it."""
    flags = ("--api-key", f"alice:{ALICE}", "--api-key", f"bob:{BOB}", "--mock-step-ms", "10",
             "--mock-stop-probability", "0")  # fmt: skip
    with running_server(*flags) as server:
        yield server


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def http(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"})


def test_another_keys_stored_response_does_not_exist(server: ServerProcess) -> None:
    alice, bob = client(server, ALICE), client(server, BOB)
    secret = alice.responses.create(model=MODEL, input="my secret plan", max_output_tokens=3)
    with pytest.raises(openai.NotFoundError) as unknown:
        bob.responses.retrieve("resp-unknown")
    with pytest.raises(openai.NotFoundError) as hers:
        bob.responses.retrieve(secret.id)
    assert str(hers.value).replace(secret.id, "resp-unknown") == str(unknown.value)
    with pytest.raises(openai.NotFoundError) as chained:
        bob.responses.create(model=MODEL, input="and?", previous_response_id=secret.id,
                             max_output_tokens=3)  # fmt: skip
    assert chained.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert alice.responses.retrieve(secret.id).output_text == secret.output_text
    mine = alice.responses.create(model=MODEL, input="and?", previous_response_id=secret.id,
                                  max_output_tokens=3)  # fmt: skip
    assert mine.status == "incomplete"


def test_another_keys_background_response_cannot_be_cancelled_or_seen(
    server: ServerProcess,
) -> None:
    alice, bob = client(server, ALICE), client(server, BOB)
    running = alice.responses.create(model=MODEL, input="long", max_output_tokens=5000,
                                     background=True)  # fmt: skip
    with http(server, ALICE) as as_alice, http(server, BOB) as as_bob:

        def slot_of(caller: httpx.Client) -> dict[str, Any] | None:
            slots = caller.get("/slots").json()["slots"]
            return next((s for s in slots if s["is_processing"]), None)

        seen = wait_until(lambda: slot_of(as_alice), 10, "alice's response in a slot")
        assert seen["request_id"] == running.id and seen["user"] == "alice"
        theirs = slot_of(as_bob)
        assert theirs is not None and "request_id" not in theirs and "user" not in theirs
        assert running.id not in as_bob.get("/slots").text
        with pytest.raises(openai.NotFoundError):
            bob.responses.cancel(running.id)
        r = as_bob.delete(f"/requests/{running.id}")
        assert r.status_code == 404 and r.headers["x-slotserve-error-code"] == "request_not_found"
        assert alice.responses.retrieve(running.id).status == "in_progress"
        assert alice.responses.cancel(running.id).status == "cancelled"


def test_metadata_follows_openais_limits(server: ServerProcess) -> None:
    alice = client(server, ALICE)
    largest = {f"{i:064d}": "v" * 512 for i in range(16)}
    kept = alice.responses.create(model=MODEL, input="hi", max_output_tokens=1, metadata=largest)
    assert alice.responses.retrieve(kept.id).metadata == largest
    too_many = {str(i): "v" for i in range(17)}
    for metadata in (too_many, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(openai.BadRequestError) as bad:
            alice.responses.create(model=MODEL, input="hi", max_output_tokens=1,
                                   metadata=metadata)  # fmt: skip
        assert str(bad.value.body["param"]).startswith("metadata")  # type: ignore[index]


def _stored(store: ResponseStore, name: str, text: str, finished: bool = True) -> Stored:
    entry = Stored(name, {"status": "completed" if finished else "in_progress", "t": text}, [],
                   set())  # fmt: skip
    if finished:
        store.finished(entry)
    store.put(entry)
    return entry


def test_the_store_is_bounded_in_bytes_oldest_finished_first() -> None:
    from app.api.adapters.responses_store import entry_bytes

    probe = Stored("a", {"status": "completed", "t": "x" * 1000}, [], set())
    one = entry_bytes(probe)
    store = ResponseStore(size=100, max_age=10.0, max_bytes=3 * one + 100)
    _stored(store, "running", "x" * 1000, finished=False)
    for name in "abc":
        _stored(store, name, "x" * 1000)
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    assert store.get("running") is not None and store.bytes <= 3 * one + 100
    _stored(store, "huge", "x" * 10_000)  # larger than the bound alone: not kept
    assert store.get("huge") is None and store.get("running") is not None


async def test_a_response_past_the_stores_byte_bound_evicts_the_oldest(
    make_client: ClientFactory,
) -> None:
    async with make_client(responses_store_bytes=40_000) as client:
        body = {"input": "hi", "max_output_tokens": 1, "metadata": {"k": "v" * 512}}
        ids = [(await client.post("/v1/responses", json=body)).json()["id"] for _ in range(40)]
        assert (await client.get(f"/v1/responses/{ids[-1]}")).status_code == 200
        assert (await client.get(f"/v1/responses/{ids[0]}")).status_code == 404
        assert client.asgi_app.state.responses.bytes <= 40_000  # type: ignore[attr-defined]
