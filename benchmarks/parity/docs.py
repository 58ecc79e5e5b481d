"""docs/vllm-differences.md, rendered from the accepted differences (accepted.py); the parity
test checks the page is current."""

from __future__ import annotations

from pathlib import Path

from parity.accepted import ACCEPTED, Accepted

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "vllm-differences.md"
HEADER = """\
# Differences from vLLM

slotserve answers as vLLM does by default. Its answers to a corpus of {count} requests
(benchmarks/parity/corpus.json: completions, chat, streamed and not, n, log probabilities, echo,
seeds, stop strings, JSON schema, tools, Responses, Messages, tokenize, models, metrics, and
invalid requests) are compared with vLLM 0.32's (its CPU build serving the same SmolLM2-135M
folder, recorded in tests/parity/data/vllm_capture.json) by `tests/parity/test_vllm_parity.py`: status, JSON
keys and types, the values clients dispatch on, stream framing and metric families (ids,
timings and generated text aside; a null field counts as absent). The differences below are
the ones kept on purpose, or not closed yet (marked **not done yet**); any other fails the test.

This page is generated from `benchmarks/parity/accepted.py`
(`python benchmarks/parity_tool.py docs`): edit that list, not this page.

| Requests | Where | What differs | Why |
|---|---|---|---|
"""


def _row(entry: Accepted) -> str:
    requests = ", ".join(f"`{r}`" for r in entry.requests)
    paths = ", ".join(f"`{p}`" for p in entry.paths)
    why = f"{entry.why} (**not done yet**)" if entry.left else entry.why
    return f"| {requests} | {paths} | {entry.what} | {why} |"


def render(accepted: tuple[Accepted, ...] = ACCEPTED, count: int | None = None) -> str:
    """The page's text."""
    from parity.record import load_corpus

    total = len(load_corpus()) if count is None else count
    rows = [_row(entry) for entry in accepted] or ["| (none) | | | |"]
    return HEADER.format(count=total) + "\n".join(rows) + "\n"
