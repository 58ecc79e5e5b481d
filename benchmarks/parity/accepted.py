"""The differences from vLLM that slotserve keeps on purpose, each with its reason. The parity
test (tests/parity/test_vllm_parity.py) fails on any other difference, and on an entry here that no
longer matches one; docs/vllm-differences.md is rendered from this list (docs.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Accepted:
    """Differences at ``paths`` (globs over paths like ``.body.choices[0].stop_reason``) of the
    requests ``requests`` (globs over corpus names): ``what`` differs, ``why`` it stays.
    ``left``: not a choice, work not done yet (the page says so)."""

    requests: tuple[str, ...]
    paths: tuple[str, ...]
    what: str
    why: str
    left: bool = False


ACCEPTED: tuple[Accepted, ...] = (
    Accepted(
        ("metrics",), (".body.vllm:estimated_*_per_gpu",),
        "vLLM's estimated FLOPs and bytes per GPU are not exported",
        "slotserve runs no GPU kernels to count; a made-up figure would mislead a utilisation "
        "panel more than its absence",
    ),
    Accepted(
        ("metrics",), (".body.vllm:cache_config_info.labels*",),
        "`vllm:cache_config_info` carries `block_size`, `num_gpu_blocks`, "
        "`enable_prefix_caching` and `engine`, not vLLM's other 32 labels",
        "those are what routers and gateways read; the others describe vLLM's internals "
        "(Mamba state, offloading, hashing options) that change between its versions and have "
        "no counterpart here",
    ),
    Accepted(
        ("metrics",), (".body.vllm:request_success.labels*",),
        "`vllm:request_success_total` has a `key` label",
        "the API key's name (empty without keys), slotserve's per-key accounting; a query "
        "summing by `finished_reason` reads the same",
    ),
    # errors (vLLM's shape: type and integer code as vLLM sends them, docs/api.md "Errors")
    Accepted(
        ("chat-content-number",), (".body.error.param",),
        "a schema error inside a message names the client's path "
        "(`body.messages.0.content`) where vLLM puts its schema's union member in it "
        "(`body.messages.0.ChatCompletionDeveloperMessageParam.content`)",
        "vLLM's path names the first of its message classes it tried, an internal name of its "
        "schema; both name the first problem's location as pydantic reports it",
    ),
    Accepted(
        ("unknown-route", "cmpl-wrong-method"), (".body.*",),
        "a 404 or 405 answer has the error shape of every other error; vLLM's is FastAPI's "
        "`{\"detail\": ...}`",
        "one error shape everywhere (status codes are the same)",
    ),
    # generation
    Accepted(
        ("chat-tools-named", "chat-stream-tools-named"),
        (".body.choices[[]0[]].*", ".body[[]*"),
        "a named `tool_choice` is answered with that call (`tool_calls`, `finish_reason: "
        "stop`; streamed, its arguments follow the name's chunk); vLLM 0.32's CPU build "
        "returned the model's own text cut at max_tokens (streamed: the name's chunk, no "
        "arguments)",
        "the named tool is forced by a grammar, as the OpenAI API promises",
    ),
    # Messages (Anthropic's error shape, as Anthropic's API answers)
    Accepted(
        ("msg-missing-max-tokens",), (".body.type", ".body.error.*"),
        "a Messages error has Anthropic's `{\"type\": \"error\", \"error\": {\"type\", "
        "\"message\"}}` shape (Anthropic's types, no `param` or `code`)",
        "Anthropic's SDKs read that shape; vLLM answers the Messages routes in OpenAI's",
    ),
)  # fmt: skip
