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
    # errors
    Accepted(
        ("*",), (".body.error.type",),
        "an error's `type` is OpenAI's (`invalid_request_error`, `not_found_error`) where vLLM "
        "sends its exception's name (`BadRequestError`, `NotFoundError`; `Bad Request` for a "
        "body that fails its schema)",
        "clients dispatch on the HTTP status, which is the same", left=True,
    ),
    Accepted(
        ("*",), (".body.error.code",),
        "an error's `code` is a string naming the problem (`context_length_exceeded`, "
        "`model_not_found`, pydantic's `int_type` ...) where vLLM repeats the HTTP status",
        "the string says what to fix; the status is the same", left=True,
    ),
    Accepted(
        ("*",), (".body.error.param",),
        "an error's `param` is the field's dotted path (`messages.0.role`) where vLLM gives "
        "pydantic's location (`body.messages.0.ChatCompletionDeveloperMessageParam.content`) "
        "or none",
        "the path a client sent, without the schema's internal union names",
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
        ("cmpl-stream-echo",), (".body*",),
        "a streamed completion with `echo` sends the prompt with the first generated text; "
        "vLLM sends the prompt in a chunk of its own (with its `prompt_token_ids`)",
        "the text streamed is the same", left=True,
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
        ("msg-missing-max-tokens",), (".body.type",),
        "a Messages error has Anthropic's `{\"type\": \"error\", \"error\": ...}` shape",
        "Anthropic's SDKs read that shape",
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
