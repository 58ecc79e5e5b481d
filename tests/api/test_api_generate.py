"""POST /generate and DELETE /requests/{id} through the ASGI app (no network)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from conftest import ClientFactory, serving_of
from error_shape import field_of
from sse import parse_sse

from app.engine.types import FinishReason
from app.serving import GenerationParams

PROMPT = "The quick brown fox "


async def test_stream_sends_tokens_then_done(make_client: ClientFactory) -> None:
    async with make_client() as client:
        r = await client.post("/generate", json={"prompt": PROMPT, "max_tokens": 30})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.text)
        *tokens, done = events
        assert {e.event for e in tokens} == {"token"} and done.event == "done"
        streamed = [t for e in tokens for t in e.data["tokens"]]
        assert streamed == done.data["tokens"]
        assert "".join(e.data["text"] for e in tokens) == done.data["text"]
        assert done.data["finish_reason"] in ("stop", "length")
        assert done.data["usage"] == {
            "prompt_tokens": len(PROMPT),
            "completion_tokens": len(streamed),
        }


class HalfCharacterModel:
    """Writes "é" (bytes C3 A9) over and over, so a length limit can cut a character in half."""

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        return [0xA9 if prefix[-1] == 0xC3 else 0xC3 for prefix in batch]


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
async def test_streamed_texts_add_up_to_the_done_text_even_mid_character(
    make_client: ClientFactory, max_tokens: int
) -> None:
    """Found in review: an output cut inside a UTF-8 character lost its last, incomplete
    character from the token events' texts, while ``done.text`` had it (as U+FFFD)."""
    async with make_client(model=HalfCharacterModel()) as client:
        r = await client.post("/generate", json={"prompt": "a", "max_tokens": max_tokens})
        *tokens, done = parse_sse(r.text)
        assert "".join(e.data["text"] for e in tokens) == done.data["text"]
        assert done.data["text"].startswith("é" * (max_tokens // 2))


async def test_stream_and_json_results_are_identical_alone_and_in_a_full_batch(
    make_client: ClientFactory,
) -> None:
    async with make_client(num_slots=4) as client:
        body = {"prompt": PROMPT, "max_tokens": 80}
        alone = (await client.post("/generate", json=body | {"stream": False})).json()
        crowd = [
            client.post("/generate", json={"prompt": f"p{i} ", "max_tokens": 80}) for i in range(7)
        ]
        results = await asyncio.gather(
            client.post("/generate", json=body),
            *crowd,
            client.post("/generate", json=body | {"stream": False}),
        )
        streamed = parse_sse(results[0].text)[-1].data
        in_batch_json = results[-1].json()
        for result in (streamed, in_batch_json):
            assert result["tokens"] == alone["tokens"]
            assert result["text"] == alone["text"]
            assert result["finish_reason"] == alone["finish_reason"]


async def test_ignore_eos_gives_exactly_max_tokens(make_client: ClientFactory) -> None:
    async with make_client() as client:
        r = await client.post(
            "/generate",
            json={"prompt": [65, 66], "max_tokens": 300, "ignore_eos": True, "stream": False},
        )
        assert r.json()["finish_reason"] == "length"
        assert len(r.json()["tokens"]) == 300


async def test_eos_ends_a_request_with_stop_and_is_not_returned(make_client: ClientFactory) -> None:
    async with make_client() as client:
        r = await client.post(
            "/generate", json={"prompt": PROMPT, "max_tokens": 4000, "stream": False}
        )
        body = r.json()
        assert body["finish_reason"] == "stop"
        assert 256 not in body["tokens"]


async def test_stop_token_ids_end_the_request(make_client: ClientFactory) -> None:
    async with make_client() as client:
        r = await client.post(
            "/generate",
            json={"prompt": PROMPT, "max_tokens": 500, "stop_token_ids": [32], "stream": False},
        )
        body = r.json()
        assert body["finish_reason"] == "stop"
        assert 32 not in body["tokens"]


async def test_max_tokens_zero_finishes_at_once(make_client: ClientFactory) -> None:
    async with make_client() as client:
        r = await client.post("/generate", json={"prompt": "hi", "max_tokens": 0})
        (done,) = parse_sse(r.text)
        assert done.event == "done"
        assert done.data["tokens"] == [] and done.data["finish_reason"] == "length"


async def test_cancel_ends_a_live_stream_with_abort(make_client: ClientFactory) -> None:
    async with make_client(mock_step_ms=2) as client:
        serving = serving_of(client)
        stream = serving.submit(
            GenerationParams(prompt=[65], max_tokens=5000, ignore_eos=True, request_id="long")
        )
        r = await client.delete("/requests/long")
        assert r.status_code == 200 and r.json() == {"request_id": "long", "cancelled": True}
        tokens, reason, _ = await stream.collect()
        assert reason is FinishReason.ABORT and len(tokens) < 5000
        missing = await client.delete("/requests/long")
        assert missing.status_code == 404
        assert missing.headers["x-slotserve-error-code"] == "request_not_found"


async def test_live_duplicate_request_id_is_409(make_client: ClientFactory) -> None:
    async with make_client(mock_step_ms=2) as client:
        serving = serving_of(client)
        stream = serving.submit(
            GenerationParams(prompt=[65], max_tokens=5000, ignore_eos=True, request_id="dup")
        )
        r = await client.post("/generate", json={"prompt": "x", "request_id": "dup"})
        assert r.status_code == 409
        assert field_of(r) == "request_id"
        serving.abort("dup")
        await stream.collect()
        again = await client.post(
            "/generate", json={"prompt": "x", "max_tokens": 3, "request_id": "dup", "stream": False}
        )
        assert again.status_code == 200 and again.json()["request_id"] == "dup"


async def test_queue_full_is_429_with_retry_after(make_client: ClientFactory) -> None:
    async with make_client(num_slots=1, max_waiting=1, mock_step_ms=2) as client:
        serving = serving_of(client)
        running = serving.submit(GenerationParams(prompt=[65], max_tokens=5000, ignore_eos=True))
        await anext(running)  # its first token: it holds the only slot
        waiting = serving.submit(GenerationParams(prompt=[65], max_tokens=5000, ignore_eos=True))
        held = [running, waiting]
        r = await client.post("/generate", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "RateLimitError"
        for stream in held:
            serving.abort(stream.request_id)


class FailingModel:
    """Raises on every call whose batch holds a prefix starting with 'X' (byte 88)."""

    def next_tokens(self, batch: list[list[int]]) -> list[int]:
        if any(prefix[0] == 88 for prefix in batch):
            raise RuntimeError("boom")
        return [65] * len(batch)


async def test_model_failure_is_an_error_event_or_500_and_others_go_on(
    make_client: ClientFactory,
) -> None:
    async with make_client(model=FailingModel()) as client:
        r = await client.post("/generate", json={"prompt": "X", "max_tokens": 5})
        (error,) = parse_sse(r.text)
        assert error.event == "error"
        assert error.data["error_code"] == "model_error"
        r = await client.post("/generate", json={"prompt": "X", "max_tokens": 5, "stream": False})
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        ok = await client.post("/generate", json={"prompt": "ok", "max_tokens": 5, "stream": False})
        assert ok.status_code == 200 and ok.json()["tokens"] == [65] * 5


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 5}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 2, 300]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt.1"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "7.5"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 9000}, "max_tokens"),
        ({"prompt": "hi", "stop_token_ids": [999]}, "stop_token_ids"),
        ({"prompt": "hi", "stream": "sometimes"}, "stream"),  # "yes" is true (lax, as vLLM)
        ({"prompt": "hi", "request_id": "bad id!"}, "request_id"),
        ({"prompt": "hi", "surprise": 1}, "surprise"),
        ({"prompt": "hi", "foo bar": 1}, "foo bar"),  # a key that looks like a union tag
    ],
)
async def test_invalid_fields_are_400_naming_the_field(
    make_client: ClientFactory, body: dict[str, object], param: str
) -> None:
    async with make_client() as client:
        r = await client.post("/generate", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        # vLLM's shape: a body failing its schema is "Bad Request" at "body.<field>"
        assert error["type"] in ("Bad Request", "BadRequestError") and error["code"] == 400
        assert field_of(r) == param and param in error["message"]


async def test_a_value_of_no_accepted_type_names_every_accepted_type(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        r = await client.post("/generate", json={"prompt": 5})
        assert (
            r.json()["error"]["message"] == "prompt: Input should be a valid list or a valid string"
        )


async def test_invalid_json_and_non_object_bodies_are_400(make_client: ClientFactory) -> None:
    async with make_client() as client:
        for content in (b"{not json", b"[1, 2]", b"null"):
            r = await client.post(
                "/generate", content=content, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, content
            assert r.json()["error"]["message"]


async def test_body_over_the_limit_is_413(make_client: ClientFactory) -> None:
    async with make_client(max_body_bytes=4096) as client:
        r = await client.post("/generate", json={"prompt": "a" * 5000})
        assert r.status_code == 413
        assert r.headers["x-slotserve-error-code"] == "request_too_large"

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
            for _ in range(8):
                yield b"x" * 1024

        r = await client.post(
            "/generate", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413


async def test_unknown_route_uses_the_error_shape(make_client: ClientFactory) -> None:
    async with make_client() as client:
        r = await client.get("/nope")
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "NotFoundError"


async def test_a_reader_that_stops_reading_is_cancelled_after_the_send_timeout(
    make_client: ClientFactory,
) -> None:
    async with make_client(send_timeout=0.2, mock_step_ms=1) as client:
        serving = serving_of(client)
        body = json.dumps({"prompt": "x", "max_tokens": 5000, "ignore_eos": True}).encode()
        stalled = asyncio.Event()
        never = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, object]:
            if messages:
                return messages.pop()
            await never.wait()  # the client neither reads nor leaves
            raise AssertionError

        async def send(message: dict[str, object]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                stalled.set()
                await never.wait()  # a full socket buffer: this send never completes

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/generate", "raw_path": b"/generate", "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())], "client": ("t", 1), "server": ("t", 80),
        }  # fmt: skip
        await asyncio.wait_for(client.asgi_app(scope, receive, send), timeout=10)  # type: ignore[attr-defined]
        assert stalled.is_set()
        await asyncio.wait_for(serving.engine.wait_idle(), timeout=10)
        assert serving.engine.core.live == {}  # aborted: its slot is free
        text = (await client.get("/metrics")).text
        assert (
            'vllm:request_success_total{engine="0",finished_reason="abort",key="",'
            'model_name="slotserve-mock"} 1.0' in text
        )
