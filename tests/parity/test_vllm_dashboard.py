"""vLLM's example Grafana dashboard (vllm-project/vllm,
examples/online_serving/prometheus_grafana/grafana.json) against slotserve: every series its
panels query exists, for the served model, once a request has run. Two of its queries use names
vLLM has since renamed (``vllm:gpu_cache_usage_perc``, ``vllm:time_per_output_token_seconds``):
vLLM 0.32 shows them only with ``--show-hidden-metrics-for-version``, and so does slotserve."""

from __future__ import annotations

from conftest import ClientFactory
from prometheus_client.parser import text_string_to_metric_families

# The metric families the dashboard's panels query (its "expr" fields), by family name.
DASHBOARD_FAMILIES = (
    "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:time_per_output_token_seconds", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
    "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm:request_success", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_max_num_generation_tokens",
)  # fmt: skip
RENAMED = {  # the older name -> the name vLLM exports today
    "vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries": "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits": "vllm:prefix_cache_hits",
    "vllm:time_per_output_token_seconds": "vllm:inter_token_latency_seconds",
}


async def families(client_factory: ClientFactory, **settings: object) -> dict[str, list[float]]:
    """Each family's sample values for model ``anchor`` after one streamed completion."""
    async with client_factory(model_name="anchor", **settings) as client:
        body = {"prompt": "hi", "max_tokens": 4, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            async for _ in reply.aiter_bytes():
                pass
        text = (await client.get("/metrics")).text
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        values = [s.value for s in family.samples if s.labels.get("model_name") == "anchor"]
        if values:
            found[family.name] = values
    return found


async def test_every_series_of_vllms_dashboard_exists_with_the_hidden_metrics_flag(
    make_client: ClientFactory,
) -> None:
    found = await families(make_client, show_hidden_metrics_for_version="0.10")
    assert [name for name in DASHBOARD_FAMILIES if name not in found] == []
    for old, new in RENAMED.items():  # the same samples under both names
        assert found[old] == found[new]


async def test_the_older_names_stay_hidden_by_default(make_client: ClientFactory) -> None:
    found = await families(make_client)
    assert not set(RENAMED) & set(found)
    assert set(RENAMED.values()) <= set(found)
