"""Failure injection end to end: a real uvicorn process, httpx and the openai client."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from deploy_files import REPO
from replicas import Replica, start_replicas
from replicas import client as nginx_client
from server_process import ServerProcess, running_server
from test_nginx import NGINX, Nginx

WAIT = 10.0
LONG = {"prompt": "Tell me everything ", "max_tokens": 8000, "ignore_eos": True}


@pytest.fixture(scope="module")
def faulty() -> Iterator[ServerProcess]:
    flags = ("--num-slots", "1", "--max-waiting", "0", "--mock-step-ms", "5")
    with running_server(*flags, "--allow-fault-headers") as server:
        yield server


def _comparable(response: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    headers = [(k, v) for k, v in response.headers.multi_items() if k != "date"]
    return response.status_code, headers, response.content


async def test_an_injected_429_is_the_real_one_over_http(faulty: ServerProcess) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "stream": False}
    async with httpx.AsyncClient(base_url=faulty.url, timeout=WAIT) as client:
        injected = await client.post(
            "/generate", json=body, headers={"x-slotserve-fail": "rate_limit"}
        )
        async with client.stream("POST", "/generate", json=LONG) as holder:
            lines = holder.aiter_lines()  # kept: a dropped iterator closes the response
            await anext(lines)  # its first event: it holds the only slot
            real = await client.post("/generate", json=body)
    assert real.status_code == 429
    assert _comparable(injected) == _comparable(real)


@pytest.mark.parametrize(
    ("kind", "error", "status"),
    [
        ("rate_limit", openai.RateLimitError, 429),
        ("invalid_api_key", openai.AuthenticationError, 401),
        ("context_length", openai.BadRequestError, 400),
        ("server_error", openai.InternalServerError, 500),
        ("model_not_found", openai.NotFoundError, 404),
        ("engine_overloaded", openai.InternalServerError, 503),
    ],
)
async def test_the_openai_client_raises_the_error_it_has_for_each_injected_failure(
    faulty: ServerProcess, kind: str, error: type[openai.APIStatusError], status: int
) -> None:
    client = openai.AsyncOpenAI(base_url=faulty.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(error) as raised:
        await client.completions.create(
            model="slotserve-mock", prompt="hi", max_tokens=3,
            extra_headers={"x-slotserve-fail": kind},
        )  # fmt: skip
    assert raised.value.status_code == status
    await client.close()


async def test_the_openai_client_sees_a_broken_stream_as_an_error_after_the_tokens(
    faulty: ServerProcess,
) -> None:
    client = openai.AsyncOpenAI(base_url=faulty.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="slotserve-mock", messages=[{"role": "user", "content": "Hello"}], max_tokens=50,
        stream=True, extra_headers={"x-slotserve-fail-after": "4"},
    )  # fmt: skip
    text = ""
    with pytest.raises(openai.APIError, match="model call failed"):
        async for chunk in stream:
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert len(text.encode()) == 4  # the mock writes one byte per token
    await client.close()


NO_RETRY = "sed 's/ http_429 http_503//'"  # docs/operations.md: let injected 429/503 through


@pytest.mark.skipif(NGINX is None, reason="no nginx binary found")
def test_nginx_hides_injected_429s_unless_the_docs_turn_its_retries_off(
    tmp_path: Path,
) -> None:
    assert NO_RETRY in (REPO / "docs" / "operations.md").read_text()
    injecting = ("--failure-rate", "1", "--failure-types", "rate_limit")
    with ExitStack() as stack:
        replicas = Replica(tmp_path, "faulty", *injecting), Replica(tmp_path, "clean")
        start_replicas(stack, tmp_path, *replicas)
        upstreams = [f"127.0.0.1:{r.port}" for r in replicas]
        for name in ("shipped", "off"):
            (tmp_path / name).mkdir()
        shipped, no_retry = (
            Nginx(tmp_path / "shipped", upstreams),
            Nginx(tmp_path / "off", upstreams),
        )
        no_retry.conf.write_text(
            subprocess.run(
                ["sh", "-c", NO_RETRY], input=no_retry.conf.read_text(), text=True,
                capture_output=True, check=True,
            ).stdout
        )  # fmt: skip
        for nginx in (shipped, no_retry):
            stack.callback(nginx.stop)
            nginx.start()
        with nginx_client() as http:
            body = {"prompt": "hi", "max_tokens": 2, "stream": False}
            hidden = [http.post(shipped.url + "/generate", json=body) for _ in range(6)]
            shown = [http.post(no_retry.url + "/generate", json=body) for _ in range(6)]
    assert [r.status_code for r in hidden] == [200] * 6  # retried on the clean replica
    refused = [r for r in shown if r.status_code == 429]
    assert refused and all(r.headers["retry-after"] == "1" for r in refused)
    assert {r.headers["x-slotserve-error-code"] for r in refused} == {"queue_full"}
