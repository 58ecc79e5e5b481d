"""The consumer's pull: ask the producer named in a decode request's parameters for its blocks.

One ``POST /v1/kv_transfer/fetch`` to ``remote_host:remote_port`` with the engine id, request id
and block ids; the producer lets the blocks go and answers how many tokens they hold. The
parameters come from a client, so the pull only goes to peers this server trusts (``peers``:
loopback and private addresses by default, as a cluster's pods have; or a list of host names)
and is bounded in time and answer size: it cannot be turned into a probe of arbitrary hosts.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

import httpx

from app.kv_transfer.params import RemoteBlocks

ERROR_CODE_HEADER = "X-Slotserve-Error-Code"  # app/api/errors.py's (no import: below the API)

FETCH_PATH = "/v1/kv_transfer/fetch"
PULL_TIMEOUT = 5.0  # seconds for the producer's whole answer (a deadline, not per read)
MAX_ANSWER_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Pulled:
    """A pull's outcome: the tokens whose KV arrived, or why none did (``failure``)."""

    num_tokens: int = 0
    failure: str | None = None  # "untrusted_peer" | "unreachable" | "unknown_engine" | "expired"


def trusted(host: str, peers: frozenset[str] | None) -> bool:
    """Whether the pull may go to ``host``: a listed peer, or (no list) a loopback or private
    address (no name lookup: a name is trusted only when listed)."""
    if peers is not None:
        return host in peers
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host == "localhost"
    return address.is_loopback or (address.is_private and not address.is_link_local)


async def pull(
    client: httpx.AsyncClient,
    blocks: RemoteBlocks,
    peers: frozenset[str] | None = None,
    key: bytes | None = None,
) -> Pulled:
    """Fetch ``blocks`` from their producer (never raises: a failure is a ``Pulled.failure``).
    ``key``: the API key the pull carries (a producer started with ``--api-key``), sent to a
    trusted peer only."""
    if not trusted(blocks.host, peers):
        return Pulled(failure="untrusted_peer")
    host = f"[{blocks.host}]" if ":" in blocks.host else blocks.host
    body = {
        "engine_id": blocks.engine_id,
        "request_id": blocks.request_id,
        "block_ids": list(blocks.block_ids),
    }
    try:  # httpx's timeout bounds each read: a peer trickling bytes needs the deadline too
        async with (
            asyncio.timeout(PULL_TIMEOUT),
            client.stream(
                "POST",
                f"http://{host}:{blocks.port}{FETCH_PATH}",
                json=body,
                timeout=PULL_TIMEOUT,
                headers={b"authorization": b"Bearer " + key} if key is not None else None,
            ) as answer,
        ):
            raw = b""
            async for chunk in answer.aiter_bytes():
                raw += chunk
                if len(raw) > MAX_ANSWER_BYTES:
                    return Pulled(failure="unreachable")
    except (httpx.HTTPError, TimeoutError):
        return Pulled(failure="unreachable")
    if answer.status_code == 404:  # the producer's error code is in its header (docs/api.md)
        code = answer.headers.get(ERROR_CODE_HEADER)
        return Pulled(failure="unknown_engine" if code == "unknown_engine" else "expired")
    if answer.status_code != 200:
        return Pulled(failure="unreachable")
    try:
        tokens = httpx.Response(200, content=raw).json()["num_tokens"]
    except (ValueError, KeyError, TypeError):
        return Pulled(failure="unreachable")
    if not isinstance(tokens, int) or tokens < 0:
        return Pulled(failure="unreachable")
    return Pulled(num_tokens=tokens)
