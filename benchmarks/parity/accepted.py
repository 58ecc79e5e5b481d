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
        ("metrics",), (".body.vllm:tool_call_parser_invocations",),
        "`vllm:tool_call_parser_invocations_total` is not exported",
        "slotserve reads tool calls with its own reader, not vLLM's parsers", left=True,
    ),
    Accepted(
        ("metrics",), (".body.vllm:request_success.labels*",),
        "`vllm:request_success_total` has a `key` label",
        "the API key's name (empty without keys), slotserve's per-key accounting; a query "
        "summing by `finished_reason` reads the same",
    ),
    # errors (vLLM's shape: type and integer code as vLLM sends them, docs/api.md "Errors")
    Accepted(
        ("chat-empty-messages", "*n2-temperature-0", "cmpl-n-0", "cmpl-*-penalty-*",
         "cmpl-token-out-of-vocab"),
        (".body.error.param",),
        "an error's `param` names the field (`n`, `presence_penalty`, `messages`, `prompt`) "
        "where vLLM's message names it but its `param` is null",
        "a client showing the error next to the field needs its name",
    ),
    Accepted(
        ("chat-top-logprobs-too-many", "chat-json-schema-no-schema", "chat-content-number",
         "cmpl-stop-not-string"),
        (".body.error.param",),
        "an error's `param` is the field the client sent, down to the wrong item "
        "(`top_logprobs`, `response_format.json_schema`, `body.stop.0`, "
        "`body.messages.0.content`) where vLLM names another (`logprobs`, `response_format`), "
        "the outer field (`body.stop`) or puts its schema's union member in the path "
        "(`body.messages.0.ChatCompletionDeveloperMessageParam.content`)",
        "the path is the client's own, as precise as it can be, without the schema's internal "
        "names",
    ),
    Accepted(
        ("cmpl-missing-prompt", "tokenize-nothing", "chat-logit-bias-bad-key"),
        (".body.error.type", ".body.error.param"),
        "a missing `prompt` on completions and a non-integer `logit_bias` key are the schema's "
        "errors (`Bad Request` at `body.<field>`) where vLLM checks them itself "
        "(`BadRequestError` at the field), and the reverse for `/tokenize` without `prompt` "
        "or `messages`",
        "each is the same 400 naming the same field; which check refuses it is an internal "
        "detail of each server's schema",
    ),
    Accepted(
        ("unknown-route", "cmpl-wrong-method"), (".body.*",),
        "a 404 or 405 answer has the error shape of every other error; vLLM's is FastAPI's "
        "`{\"detail\": ...}`",
        "one error shape everywhere (status codes are the same)",
    ),
    Accepted(
        ("cmpl-max-tokens-string", "cmpl-seed-string"), ("*",),
        "an integer field sent as a string (`\"5\"`) is a 400; vLLM converts it",
        "integers are strict here (`\"5\"` and `5.0` refused) so a client's type mistake "
        "is named, not guessed",
    ),
    Accepted(
        ("detokenize-out-of-vocab",), ("*",),
        "`/detokenize` of an id outside the vocabulary is a 400; vLLM answers 200",
        "a client's mistake gets a clear error, not a guess",
    ),
    # routes
    Accepted(
        ("health",), ("*",),
        "`/health` answers `{\"status\": \"ok\"}`; vLLM's body is empty",
        "the 503 body says why it is not serving; probes read the status, which is the same",
    ),
    # generation
    Accepted(
        ("chat-tools-named", "chat-tools-required", "chat-tool-result"),
        (".body.usage.prompt_tokens",),
        "a chat with tools has more prompt tokens (SmolLM2: 136 against 34)",
        "when the chat template cannot render tools (SmolLM2's cannot), slotserve describes "
        "them in a system message; vLLM then sends the model no tools at all",
    ),
    Accepted(
        ("chat-tools-named",), (".body.choices[[]0[]].*",),
        "a named `tool_choice` is answered with that call (`tool_calls`); vLLM 0.32's CPU "
        "build returned the model's own text, cut at max_tokens",
        "the named tool is forced by a grammar, as the OpenAI API promises",
    ),
    Accepted(
        ("chat-stream-tools-named",), (".body*",),
        "a streamed named tool call sends the name and the arguments in the first chunk where "
        "vLLM sends the name first and the arguments after",
        "both are OpenAI's streamed call; a client concatenates the arguments either way",
    ),
    Accepted(
        ("chat-stream-n2", "chat-stream-json-schema"), (".body*",),
        "chunk layout of a stream: how n choices interleave, whether the last chunk carries "
        "text",
        "decided by generation timing and the text, not by a protocol rule",
    ),
    # Messages (Anthropic's shape, as Anthropic's API answers)
    Accepted(
        ("msg-*",), ("*.usage.cache_*_input_tokens",),
        "Messages usage has `cache_creation_input_tokens` and `cache_read_input_tokens`",
        "Anthropic's API sends them (0 here)",
    ),
    Accepted(
        ("msg-stream",), (".body[[]2:2[]]",),
        "a Messages stream sends a `ping` event after `content_block_start`",
        "Anthropic's API does; its SDKs expect and skip it",
    ),
    Accepted(
        ("msg-bad-role",), ("*",),
        "a Messages request with a `system` message in `messages` is a 400; vLLM answers it",
        "Anthropic's API refuses it (the system prompt is the `system` field)",
    ),
    Accepted(
        ("msg-missing-max-tokens",), (".body.type", ".body.error.*"),
        "a Messages error has Anthropic's `{\"type\": \"error\", \"error\": {\"type\", "
        "\"message\"}}` shape (Anthropic's types, no `param` or `code`)",
        "Anthropic's SDKs read that shape; vLLM answers the Messages routes in OpenAI's",
    ),
    # Responses
    Accepted(
        ("resp-*",), ("*.usage.*_details.*",),
        "Responses usage lacks vLLM's `cache_write_tokens`, `tool_output_tokens` and per-turn "
        "lists",
        "vLLM's extensions for its built-in tools' turns; OpenAI's usage fields are all there",
    ),
    Accepted(
        ("resp-*",), ("*.metadata", "*.text", "*.store", "*.logprobs"),
        "a response shows OpenAI's defaults (`metadata: {}`, `text.format` text, `store: true`, "
        "`logprobs: []` on a text part) where vLLM sends null or nothing",
        "what OpenAI's API answers; an SDK reads both",
    ),
    Accepted(
        ("resp-stream",), ("*.output[[]0[]].status", "*.item.status"),
        "a message cut by `max_output_tokens` has status `incomplete` where vLLM says "
        "`completed` (the response itself is `incomplete` in both)",
        "OpenAI marks the cut item incomplete",
    ),
)  # fmt: skip
