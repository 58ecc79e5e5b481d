"""/health, /metrics, /slots and API-key auth through the ASGI app."""

from __future__ import annotations

from conftest import ClientFactory, serving_of

from app.serving import GenerationParams
from app.version import version


async def test_health_is_200_while_serving_and_503_once_draining(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        ok = await client.get("/health")  # as vLLM answers it: 200, an empty body
        assert (ok.status_code, ok.content, ok.headers.get("content-type")) == (200, b"", None)
        await serving_of(client).stop()
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        r = await client.post("/generate", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["x-slotserve-error-code"] == "draining"


async def test_version_answers_as_vllm_does(make_client: ClientFactory) -> None:
    """vLLM's GET /version: a client or router probing it gets 200 and a version string."""
    async with make_client() as client:
        r = await client.get("/version")
        assert r.status_code == 200 and r.json() == {"version": version()}


async def test_metrics_use_vllm_names_and_count_requests(make_client: ClientFactory) -> None:
    async with make_client(model_name="m") as client:
        for _ in range(3):
            await client.post(
                "/generate",
                json={"prompt": "ab", "max_tokens": 5, "ignore_eos": True, "stream": False},
            )
        text = (await client.get("/metrics")).text
        assert (
            'vllm:request_success_total{engine="0",finished_reason="length",key="",'
            'model_name="m"} 3.0' in text
        )
        assert 'vllm:generation_tokens_total{engine="0",model_name="m"} 15.0' in text
        assert 'vllm:prompt_tokens_total{engine="0",model_name="m"} 6.0' in text
        for name in (
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
            "slotserve:slots_total", "slotserve:step_duration_seconds_bucket",
        ):  # fmt: skip
            assert name in text, name
        # 3 requests x 4 gaps between their 5 tokens
        assert 'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 12.0' in text


async def test_gauges_are_fresh_right_after_aborts(make_client: ClientFactory) -> None:
    async with make_client(num_slots=2, mock_step_ms=2) as client:
        serving = serving_of(client)
        streams = [
            serving.submit(GenerationParams(prompt=[65], max_tokens=8000, ignore_eos=True))
            for _ in range(4)
        ]
        await anext(streams[0])
        for stream in streams:
            serving.abort(stream.request_id)
        for stream in streams:
            await stream.collect()
        text = (await client.get("/metrics")).text
        assert 'vllm:num_requests_running{engine="0",model_name="slotserve-mock"} 0.0' in text
        assert 'vllm:num_requests_waiting{engine="0",model_name="slotserve-mock"} 0.0' in text
        assert (
            'vllm:request_success_total{engine="0",finished_reason="abort",key="",'
            'model_name="slotserve-mock"} 4.0' in text
        )


async def test_slots_show_the_running_requests(make_client: ClientFactory) -> None:
    async with make_client(num_slots=2, mock_step_ms=2) as client:
        serving = serving_of(client)
        stream = serving.submit(
            GenerationParams(prompt=[65, 66], max_tokens=8000, ignore_eos=True, request_id="r1")
        )
        await anext(stream)
        table = (await client.get("/slots")).json()
        assert table["num_slots"] == 2 and table["running"] == 1
        busy = [s for s in table["slots"] if s["is_processing"]]
        assert busy[0]["request_id"] == "r1" and busy[0]["max_tokens"] == 8000
        assert busy[0]["prompt_tokens"] == 2 and busy[0]["n_decoded"] >= 1
        serving.abort("r1")
        await stream.collect()


JSON = {"content-type": "application/json"}
KEY = {"authorization": "Bearer s3cret"}


async def test_api_key_guards_generation_cancel_and_slots_but_not_health(
    make_client: ClientFactory,
) -> None:
    async with make_client(api_key="s3cret") as client:
        routes = [
            ("POST", "/generate", {"prompt": "x", "max_tokens": 1, "stream": False}),
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
            (
                "POST",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
            ),
            ("GET", "/v1/models", None),
            ("GET", "/slots", None),
            ("DELETE", "/requests/abc", None),
        ]
        for method, path, body in routes:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                r = await client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "AuthenticationError"
            r = await client.request(
                method, path, json=body, headers={"authorization": "Bearer s3cret"}
            )
            assert r.status_code in (200, 404), (path, r.text)  # 404: the unknown request id
        assert (await client.get("/health")).status_code == 200
        for broken in (b"{not json", b'{"prompt": 5}'):  # no key: 401 before any 400
            r = await client.post("/generate", content=broken, headers=JSON)
            assert r.status_code == 401, r.text
        r = await client.post("/generate", content=b"{not json", headers=JSON | KEY)
        assert r.status_code == 400
