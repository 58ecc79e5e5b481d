"""The differences from vLLM that slotserve keeps on purpose, each with its reason. The parity
test (tests/test_vllm_parity.py) fails on any other difference, and on an entry here that no
longer matches one; docs/vllm-differences.md is rendered from this list (docs.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Accepted:
    """Differences at ``path`` (a glob over paths like ``.body.choices[0].stop_reason``) of the
    requests ``requests`` (globs over corpus names): ``what`` differs, ``why`` it stays.
    ``left``: not a choice, work not done yet (the page says so)."""

    requests: tuple[str, ...]
    path: str
    what: str
    why: str
    left: bool = False


ACCEPTED: tuple[Accepted, ...] = (
    Accepted(
        ("metrics",), ".body.vllm:estimated_*_per_gpu",
        "vLLM's estimated FLOPs and bytes per GPU are not exported",
        "slotserve runs no GPU kernels to count; a made-up figure would mislead a utilisation "
        "panel more than its absence",
    ),
    Accepted(
        ("metrics",), ".body.vllm:cache_config_info",
        "`vllm:cache_config_info` is not exported",
        "its 35 labels are vLLM's cache configuration (GPU memory utilisation, Mamba options "
        "...), most with no counterpart here",
        left=True,
    ),
    Accepted(
        ("metrics",), ".body.vllm:tool_call_parser_invocations",
        "`vllm:tool_call_parser_invocations_total` is not exported",
        "slotserve reads tool calls with its own reader, not vLLM's parsers", left=True,
    ),
    Accepted(
        ("metrics",), ".body.vllm:request_success.labels*",
        "`vllm:request_success_total` has a `key` label",
        "the API key's name (empty without keys), slotserve's per-key accounting; a query "
        "summing by `finished_reason` reads the same",
    ),
)  # fmt: skip
