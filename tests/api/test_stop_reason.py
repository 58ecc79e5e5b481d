"""vLLM's ``stop_reason`` on the OpenAI routes: the stop string that ended a choice, or the id
of a ``stop_token_ids`` token that did (never the end-of-sequence token: then null, as vLLM)."""

from __future__ import annotations

import json

from conftest import ClientFactory

PROMPT = {"prompt": "Once upon", "temperature": 0, "max_tokens": 400}  # the mock: " busy m..."
M = ord("m")


async def test_a_stop_token_id_is_the_stop_reason(make_client: ClientFactory) -> None:
    async with make_client() as client:
        whole = await client.post("/v1/completions", json={**PROMPT, "stop_token_ids": [M]})
        choice = whole.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
            " busy ", "stop", M,
        )  # fmt: skip
        streamed = await client.post(
            "/v1/completions", json={**PROMPT, "stop_token_ids": [M], "stream": True}
        )
        chunks = [
            json.loads(line[6:]) for line in streamed.text.splitlines()
            if line.startswith("data: {")
        ]  # fmt: skip
        assert chunks[-1]["choices"][0]["stop_reason"] == M
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                  "stop_token_ids": [ord("o")], "n": 1},
        )  # fmt: skip
        assert chat.json()["choices"][0]["stop_reason"] == ord("o")


async def test_end_of_sequence_is_no_stop_reason(make_client: ClientFactory) -> None:
    """vLLM checks the end-of-sequence token first: listed in ``stop_token_ids`` or not, a
    choice it ends has ``stop_reason`` null."""
    async with make_client() as client:
        body = {"prompt": "Once upon", "max_tokens": 1000, "seed": 1, "stop_token_ids": [256]}
        r = await client.post("/v1/completions", json=body)  # the mock ends its sentences
        choice = r.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
