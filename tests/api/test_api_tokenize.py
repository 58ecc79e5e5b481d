"""``/tokenize`` and ``/detokenize`` in vLLM's shapes, with the mock's byte tokenizer."""

from __future__ import annotations

from conftest import ClientFactory
from error_shape import field_of

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_tokenize_a_prompt_and_a_chat_as_the_generation_routes_do(
    make_client: ClientFactory,
) -> None:
    async with make_client(max_model_len=512) as client:
        r = await client.post("/tokenize", json={"prompt": "hé", "return_token_strs": True})
        assert r.json() == {"count": 3, "max_model_len": 512, "tokens": [104, 195, 169],
                            "token_strs": ["h", "\ufffd", "\ufffd"]}  # fmt: skip
        chat = (await client.post("/tokenize", json={"messages": MESSAGES})).json()
        reply = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert chat["count"] == reply.json()["usage"]["prompt_tokens"]
        assert chat["token_strs"] is None
        text = (await client.post("/detokenize", json={"tokens": chat["tokens"]})).json()
        assert text == {"prompt": "user: hi\nassistant: "}


async def test_a_developer_message_is_rendered_as_a_system_one(make_client: ClientFactory) -> None:
    """vLLM gives the chat template a developer message as a system one (a template that adds
    its default system prompt when the first message is not one then adds none)."""
    chats = [[{"role": role, "content": "be terse"}, *MESSAGES] for role in ("developer", "system")]
    async with make_client() as client:
        developer, system = [
            (
                await client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 1})
            ).json()["usage"]["prompt_tokens"]
            for chat in chats
        ]
        tokens = [(await client.post("/tokenize", json={"messages": c})).json()["tokens"]
                  for c in chats]  # fmt: skip
    assert developer == system and tokens[0] == tokens[1]


async def test_detokenize_decodes_ids_past_the_vocabulary_to_nothing(
    make_client: ClientFactory,
) -> None:
    """As vLLM answers it (200): an id the vocabulary lacks adds no text."""
    async with make_client() as client:
        known = (await client.post("/detokenize", json={"tokens": [104, 105]})).json()
        r = await client.post("/detokenize", json={"tokens": [104, 257, 105, 10**9]})
        assert r.status_code == 200 and r.json() == known and known["prompt"]


async def test_tokenizer_routes_refuse_bad_input(make_client: ClientFactory) -> None:
    async with make_client() as client:
        r = await client.post("/detokenize", json={"tokens": [1, -1]})
        assert r.status_code == 400 and field_of(r) == "tokens.1"
        r = await client.post("/tokenize", json={"prompt": "a", "messages": MESSAGES})
        assert r.status_code == 400 and field_of(r) == "prompt"
        r = await client.post("/tokenize", json={})
        assert r.status_code == 400
        r = await client.post("/tokenize", json={"prompt": "a", "add_special_tokens": False})
        assert r.status_code == 400 and field_of(r) == "add_special_tokens"
        r = await client.post("/tokenize", json={"prompt": "a", "model": "other"})
        assert r.status_code == 404 and r.headers["x-slotserve-error-code"] == "model_not_found"
