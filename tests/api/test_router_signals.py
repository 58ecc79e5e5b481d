"""The load signals routers read, in vLLM's and the vLLM router's shapes (app/api/load.py,
app/api/render.py, ``vllm:cache_config_info``)."""

from __future__ import annotations

import json

from conftest import ClientFactory, serving_of

from app.serving import GenerationParams

CHAT = [{"role": "user", "content": "hi"}]


async def test_get_load_counts_the_requests_the_engine_holds(make_client: ClientFactory) -> None:
    """The vLLM router's power_of_two reads the integer ``load`` (running + waiting)."""
    async with make_client(num_slots=1, mock_step_ms=2) as client:
        assert (await client.get("/get_load")).json() == {
            "load": 0, "num_requests_running": 0, "num_requests_waiting": 0,
        }  # fmt: skip
        serving = serving_of(client)
        running = serving.submit(GenerationParams(prompt=[65], max_tokens=5000, ignore_eos=True))
        await anext(running)  # its first token: it holds the only slot
        waiting = serving.submit(GenerationParams(prompt=[65], max_tokens=5000, ignore_eos=True))
        assert (await client.get("/get_load")).json() == {
            "load": 2, "num_requests_running": 1, "num_requests_waiting": 1,
        }  # fmt: skip
        for stream in (running, waiting):
            serving.abort(stream.request_id)
            await stream.collect()
        assert (await client.get("/get_load")).json()["load"] == 0


async def test_get_load_sums_the_data_parallel_ranks(make_client: ClientFactory) -> None:
    async with make_client(data_parallel_size=2, num_slots=1, mock_step_ms=2) as client:
        serving = serving_of(client)
        held = [
            serving.submit(GenerationParams(prompt=[65], max_tokens=5000, ignore_eos=True))
            for _ in range(2)
        ]  # one per rank (the least loaded rank takes each)
        for stream in held:
            await anext(stream)
        assert (await client.get("/get_load")).json()["num_requests_running"] == 2
        for stream in held:
            serving.abort(stream.request_id)


async def test_get_load_needs_no_api_key(make_client: ClientFactory) -> None:
    """The vLLM router polls ``/get_load`` without credentials (vLLM keeps it open: its keys
    guard ``/v1`` only), so with ``--api-key`` it stays open as ``/metrics`` is; before, it
    answered 401 and ``power_of_two`` saw no load anywhere."""
    async with make_client(api_key=["sekret"]) as client:
        assert (await client.get("/get_load")).json()["load"] == 0
        render = await client.post("/v1/completions/render", json={"prompt": "a"})
        assert render.status_code == 401  # the /v1 routes keep their key


async def test_orca_header_on_non_streamed_answers_as_vllm_writes_it(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        body = {"prompt": "hi", "max_tokens": 2}
        text = await client.post(
            "/v1/completions", json=body, headers={"endpoint-load-metrics-format": "TEXT"}
        )
        assert text.status_code == 200
        assert text.headers["endpoint-load-metrics"] == (
            "TEXT named_metrics.kv_cache_usage_perc=0.0, named_metrics.num_requests_waiting=0.0"
        )
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 2},
            headers={"endpoint-load-metrics-format": "json"},
        )
        kind, report = chat.headers["endpoint-load-metrics"].split(" ", 1)
        assert kind == "JSON"
        assert json.loads(report) == {
            "named_metrics": {"kv_cache_usage_perc": 0.0, "num_requests_waiting": 0.0}
        }
        # not asked, another format, a stream, an error: no header (as vLLM)
        plain = await client.post("/v1/completions", json=body)
        other = await client.post(
            "/v1/completions", json=body, headers={"endpoint-load-metrics-format": "PROTO"}
        )
        streamed = await client.post(
            "/v1/completions", json={**body, "stream": True},
            headers={"endpoint-load-metrics-format": "TEXT"},
        )  # fmt: skip
        refused = await client.post(
            "/v1/completions", json={**body, "model": "other"},
            headers={"endpoint-load-metrics-format": "TEXT"},
        )  # fmt: skip
        assert refused.status_code == 404
        for response in (plain, other, streamed, refused):
            assert "endpoint-load-metrics" not in response.headers


async def test_render_gives_the_token_ids_generation_feeds(make_client: ClientFactory) -> None:
    """vLLM's render shapes: a list of GenerateRequests for completions (one per prompt), one
    GenerateRequest for a chat; the ids are what the generation routes count as the prompt."""
    async with make_client(max_model_len=512) as client:
        r = await client.post(
            "/v1/completions/render", json={"prompt": ["hé", "ab"], "max_tokens": 7}
        )
        assert r.status_code == 200
        first, second = r.json()
        assert first["token_ids"] == [104, 195, 169] and second["token_ids"] == [97, 98]
        assert first["request_id"].startswith("cmpl-")
        assert first["sampling_params"]["max_tokens"] == 7
        assert first["kv_transfer_params"] is None and first["stream"] is False
        chat = (
            await client.post(
                "/v1/chat/completions/render",
                json={"messages": CHAT, "stream": True, "stream_options": {"include_usage": True}},
            )
        ).json()
        assert chat["request_id"].startswith("chatcmpl-")
        assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
        reply = await client.post("/v1/chat/completions", json={"messages": CHAT})
        assert len(chat["token_ids"]) == reply.json()["usage"]["prompt_tokens"]
        tokenized = await client.post("/tokenize", json={"messages": CHAT})
        assert chat["token_ids"] == tokenized.json()["tokens"]
        # max_tokens omitted: --default-max-tokens, capped by the room left (as the chat route)
        default = serving_of(client).settings.default_max_tokens
        assert chat["sampling_params"]["max_tokens"] == min(default, 512 - len(chat["token_ids"]))


async def test_render_refuses_bad_input(make_client: ClientFactory) -> None:
    async with make_client(max_model_len=512) as client:
        r = await client.post("/v1/completions/render", json={"prompt": "a", "model": "other"})
        assert r.status_code == 404 and r.headers["x-slotserve-error-code"] == "model_not_found"
        r = await client.post("/v1/chat/completions/render", json={"messages": []})
        assert r.status_code == 400
        r = await client.post(
            "/v1/completions/render", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
        )
        assert r.status_code == 413
        r = await client.post("/v1/completions/render", json={"prompt": "a" * 600})
        assert (
            r.status_code == 400
            and r.headers["x-slotserve-error-code"] == "context_length_exceeded"
        )
        generated = await client.post("/v1/completions", json={"prompt": "a" * 600})
        assert generated.headers["x-slotserve-error-code"] == "context_length_exceeded"


async def test_cache_config_info_describes_the_cache(make_client: ClientFactory) -> None:
    async with make_client(
        block_size=16, kv_cache_tokens=1024, enable_prefix_caching=True
    ) as client:
        text = (await client.get("/metrics")).text
        line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
        assert 'block_size="16"' in line and 'num_gpu_blocks="64"' in line
        assert 'enable_prefix_caching="True"' in line and line.endswith(" 1.0")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
RENDER_CASES = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0}),
    ("/v1/completions", {"prompt": "hi", "n": 17}),  # past --max-n
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}),
    ("/v1/completions", {"prompt": [[104, 105], []]}),  # an empty prompt
    ("/v1/completions", {"prompt": [999999]}),  # outside the vocabulary
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 3, "temperature": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [999999]}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}),
]  # fmt: skip


async def test_render_refuses_what_generation_refuses(make_client: ClientFactory) -> None:
    """A render reads its body as the generation route does: the request it describes would be
    refused there, so it is refused here, with the same answer (it answered 200 before)."""
    async with make_client() as client:
        for route, body in RENDER_CASES:
            generated = await client.post(route, json=body)
            rendered = await client.post(f"{route}/render", json=body)
            assert generated.status_code == 400, (route, body)
            assert rendered.status_code == 400, (route, body, rendered.text)
            assert rendered.json()["error"] == generated.json()["error"], (route, body)


async def test_render_draws_no_mock_tool_decision(make_client: ClientFactory) -> None:
    """Under ``auto`` a mock draws whether it calls a tool from a generator seeded by --seed; a
    render only describes a request, so it draws nothing: the chats after renders answer as
    they would without them (before, each render shifted the draws)."""
    body = {"messages": CHAT, "tools": TOOLS, "max_tokens": 40, "temperature": 0}

    async def replies(render: bool) -> list[str]:
        async with make_client(mock_tool_call_probability=0.5, seed=7) as client:
            out = []
            for _ in range(8):
                if render:
                    await client.post("/v1/chat/completions/render", json=body)
                reply = await client.post("/v1/chat/completions", json=body)
                out.append(json.dumps(reply.json()["choices"][0]["message"]))
            return out

    assert await replies(render=True) == await replies(render=False)
