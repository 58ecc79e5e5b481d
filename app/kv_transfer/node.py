"""This server's side of prefill/decode disaggregation: its role, the link, the peers it trusts.

``KVTransfer`` is built once from the settings (``from_settings``; None without
``--kv-transfer-config``). The API uses it to check a request's ``kv_transfer_params`` against
the role (``intent``), to fill a producer's answer (``answer``), to receive a consumer's blocks
(``receive``: the pull, then the link's time) and to let a producer's blocks go when a consumer
gives up on them (``release``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.config import Settings
from app.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from app.kv_transfer.link import DEFAULT_KV_BYTES_PER_TOKEN, Link
from app.kv_transfer.params import (
    RemoteBlocks,
    TransferIntent,
    TransferParamsError,
    parse_transfer_params,
)
from app.kv_transfer.pull import Pulled, pull

FIELD = "kv_transfer_params"
WILDCARD_HOSTS = ("0.0.0.0", "::", "", "[::]")


def check_intent(config: KVTransferConfig | None, raw: Any) -> TransferIntent | None:
    """``raw`` (a request's ``kv_transfer_params``) validated against this server's role:
    ``TransferParamsError`` naming the field for a wrong shape, or for an ask this server cannot
    serve (no ``--kv-transfer-config``; a producer asked to decode a remote prefill; a consumer
    asked to prefill for a remote decoder)."""
    intent = parse_transfer_params(raw, FIELD)
    if intent is None:
        return None
    param = f"{FIELD}.{'do_remote_decode' if intent.remote_decode else 'do_remote_prefill'}"
    if config is None:
        problem = (
            " needs a server started with --kv-transfer-config (prefill/decode disaggregation "
            "is off here)"
        )
    elif intent.remote_decode and not config.produces:
        problem = (
            ": this server is a kv_consumer (it decodes, it does not prefill for another server)"
        )
    elif intent.remote_prefill is not None and not config.consumes:
        problem = (
            ": this server is a kv_producer (it prefills for another server, it does not decode "
            "a remote prefill)"
        )
    else:
        return intent
    raise TransferParamsError(param + problem, param)


def kv_bytes_per_token(settings: Settings) -> int:
    """The model's KV bytes per token, all of it (every layer and KV head, summed over the
    tensor-parallel GPUs: one link carries the whole prompt's KV, the conservative case): the
    GPU profile's, else ``--model-config``'s, else ``link``'s default (Llama-3.1-8B)."""
    if settings.profile is not None:
        from app.profiles import PROFILES

        return PROFILES[settings.profile].kv_bytes_per_token
    if settings.model_config_file is not None:
        from app.step_time.model_config import load_model_config

        return load_model_config(settings.model_config_file).kv_bytes_per_token(1)
    return DEFAULT_KV_BYTES_PER_TOKEN


def tensor_parallel_size(settings: Settings) -> int:
    """The ``tp_size`` a producer's answer names: the profile's GPUs, else the flag's."""
    if settings.profile is not None:
        from app.profiles import PROFILES

        return PROFILES[settings.profile].gpus
    return settings.tensor_parallel_size


@dataclass(slots=True)
class KVTransfer:
    """The role and link of this server, where its answers say its blocks are, and the peers
    it pulls from (None: loopback and private addresses)."""

    config: KVTransferConfig
    link: Link
    host: str
    port: int
    peers: frozenset[str] | None = None
    tp_size: int = 1
    key: bytes | None = field(default=None, repr=False)  # its pulls' API key (--api-key)
    _client: httpx.AsyncClient | None = field(default=None, repr=False)
    _releases: set[asyncio.Task[Pulled]] = field(default_factory=set, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> KVTransfer | None:
        """None without ``--kv-transfer-config``; ``ValueError`` naming the flag if wrong."""
        if settings.kv_transfer_config is None:
            return None
        config = parse_kv_transfer_config(settings.kv_transfer_config)
        link = Link(
            kv_bytes_per_token(settings),
            settings.kv_transfer_bandwidth_gbps,
            settings.kv_transfer_latency_ms,
        )
        host = settings.kv_transfer_host or (
            "127.0.0.1" if settings.host in WILDCARD_HOSTS else settings.host
        )
        peers = None
        if settings.kv_transfer_peers is not None:
            peers = frozenset(p.strip() for p in settings.kv_transfer_peers.split(",") if p.strip())
        keys = settings.api_keys().keys  # a deployment's servers share their keys
        key = keys[0].secret if keys else None
        tp_size = tensor_parallel_size(settings)
        return cls(config, link, host, settings.port, peers, tp_size, key)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False)
        return self._client

    async def close(self) -> None:
        for task in list(self._releases):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def answer(self, request_id: str, block_ids: tuple[int, ...]) -> dict[str, Any]:
        """A producer's ``kv_transfer_params`` (vLLM's NIXL connector's shape) for the request
        ``request_id`` whose blocks ``block_ids`` it holds."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
        }

    async def receive(self, blocks: RemoteBlocks, prompt_len: int) -> Pulled:
        """Pull ``blocks`` from their producer, then wait for their KV to cross the link.
        ``Pulled.num_tokens``: the prompt's leading tokens now computed (at most
        ``prompt_len - 1``: the last is fed, to sample from); a failure pulls nothing."""
        pulled = await pull(self.client, blocks, self.peers, self.key)
        if pulled.failure is not None:
            return pulled
        tokens = min(pulled.num_tokens, prompt_len - 1)
        await asyncio.sleep(self.link.seconds(tokens))
        return Pulled(num_tokens=tokens)

    def release(self, blocks: RemoteBlocks) -> None:
        """The consumer gave up on ``blocks`` (its client left while they were on their way):
        fetch them anyway, in the background, so the producer lets them go now."""
        pull_ = pull(self.client, blocks, self.peers, self.key)
        task = asyncio.get_running_loop().create_task(pull_)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
