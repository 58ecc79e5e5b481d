"""LoRA adapters (simulated, ``--enable-lora``) on ``/v1/responses`` and ``/v1/messages``, as on
chat: ``model`` may name a loaded adapter, the request runs with it (the scheduler sees its
adapter) and the reply names it; an unknown model is chat's 404. Official SDKs, real server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from error_shape import field_of
from lora_adapter import adapter_dir
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, running_server, wait_until

HI: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = adapter_dir(tmp_path_factory.mktemp("adapter"))
    with running_server(
        "--enable-lora", "--max-cpu-loras", "2", "--lora-modules", f"sql={path}", f"chat={path}",
        "--num-slots", "1", "--mock-step-ms", "2",
    ) as running:  # fmt: skip
        yield running


def _openai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _anthropic(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_responses_serve_an_adapter_streamed_and_not(server: ServerProcess) -> None:
    client = _openai(server)
    reply = client.responses.create(model="sql", input="Hi", max_output_tokens=8)
    assert reply.model == "sql" and reply.status in ("completed", "incomplete")
    assert reply.output_text
    with client.responses.stream(model="sql", input="Hi", max_output_tokens=8) as stream:
        events = list(stream)
    models = {e.response.model for e in events if hasattr(e, "response")}
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")  # at max_output_tokens
    assert models == {"sql"} and final.response.output_text
    assert client.responses.retrieve(final.response.id).model == "sql"  # stored as it answered


def test_messages_serve_an_adapter_streamed_and_not(server: ServerProcess) -> None:
    client = _anthropic(server)
    message = client.messages.create(model="chat", max_tokens=8, messages=HI)
    assert message.model == "chat" and message.content
    with client.messages.stream(model="chat", max_tokens=8, messages=HI) as stream:
        starts = [e.message.model for e in stream if e.type == "message_start"]
        final = stream.get_final_message()
    assert starts == ["chat"] and final.model == "chat" and final.content
    counted = client.messages.count_tokens(model="chat", messages=HI)
    assert counted.input_tokens > 0


def test_an_unknown_model_is_the_404_chat_gives(server: ServerProcess) -> None:
    client = _openai(server)
    with pytest.raises(openai.NotFoundError) as on_chat:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.NotFoundError) as on_responses:
        client.responses.create(model="nope", input="Hi")
    chat_error = on_chat.value.body
    assert isinstance(chat_error, dict) and on_responses.value.body == chat_error
    assert chat_error["code"] == 404 and field_of(chat_error) == "model"
    assert on_chat.value.response.headers["x-slotserve-error-code"] == "model_not_found"
    claude = _anthropic(server)
    with pytest.raises(anthropic.NotFoundError) as on_messages:
        claude.messages.create(model="nope", max_tokens=8, messages=HI)
    assert on_messages.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": chat_error["message"]},
    }
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="nope", messages=HI)


def test_the_request_runs_with_its_adapter(server: ServerProcess) -> None:
    """The scheduler sees each request's adapter: while a base-model request holds the only
    slot, a Responses request on ``sql`` and a Messages request on ``chat`` wait, and
    ``vllm:lora_requests_info`` names both adapters as waiting."""
    hold = {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "request_id": "hold"}
    started = threading.Event()

    def holding() -> list[str]:  # read (as a client does), else the send watchdog ends it
        with httpx.stream("POST", server.url + "/generate", json=hold, timeout=30) as held:
            lines = []
            for line in held.iter_lines():
                lines.append(line)
                started.set()
            return lines

    with ThreadPoolExecutor(3) as pool:
        held = pool.submit(holding)
        assert started.wait(timeout=30)  # it runs in the slot
        reply = pool.submit(
            _openai(server).responses.create, model="sql", input="Hi", max_output_tokens=4
        )
        message = pool.submit(
            _anthropic(server).messages.create, model="chat", max_tokens=4, messages=HI
        )
        info = wait_until(lambda: _waiting(server, "chat,sql"), 10, "both adapters waiting")
        assert info["running_lora_adapters"] == ""
        assert httpx.delete(server.url + "/requests/hold").status_code == 200
        assert '"finish_reason":"abort"' in held.result(timeout=30)[-2]
        assert reply.result(timeout=30).model == "sql"
        assert message.result(timeout=30).model == "chat"


def _waiting(server: ServerProcess, adapters: str) -> dict[str, str] | None:
    """``vllm:lora_requests_info``'s labels once they name ``adapters`` as waiting."""
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:lora_requests_info":
            labels = dict(family.samples[0].labels)
            return labels if labels["waiting_lora_adapters"] == adapters else None
    return None
