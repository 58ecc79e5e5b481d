"""``--kv-transfer-config``: vLLM's JSON, as ``vllm serve --kv-transfer-config`` takes it."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["kv_producer", "kv_consumer", "kv_both"]
ROLES: tuple[Role, ...] = ("kv_producer", "kv_consumer", "kv_both")
# The connectors whose request/response parameters this simulation speaks (the pull-based ones
# the vLLM router's ``--kv-connector`` values and llm-d configure).
CONNECTORS = (
    "NixlConnector", "MooncakeConnector", "MoRIIOConnector", "P2pNcclConnector",
    "LMCacheConnectorV1",
)  # fmt: skip
MAX_CONFIG_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """The connector, this server's role, and the id the parameters carry (``engine_id``:
    vLLM's default is a fresh UUID per start)."""

    kv_connector: str
    kv_role: Role
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config, kept as is

    @property
    def produces(self) -> bool:
        """Whether this server prefills for another's decode (holds blocks for a pull)."""
        return self.kv_role != "kv_consumer"

    @property
    def consumes(self) -> bool:
        """Whether this server decodes requests another prefilled (pulls blocks)."""
        return self.kv_role != "kv_producer"


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """The config in ``text``; ``ValueError`` naming the field that is wrong."""
    if len(text.encode()) > MAX_CONFIG_BYTES:
        raise ValueError(f"--kv-transfer-config is over {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--kv-transfer-config is not JSON: {err.msg}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    connector = raw.get("kv_connector")
    if connector not in CONNECTORS:
        raise ValueError(f"kv_connector must be one of {', '.join(CONNECTORS)}, got {connector!r}")
    role = raw.get("kv_role")
    if role not in ROLES:
        raise ValueError(f"kv_role must be one of {', '.join(ROLES)}, got {role!r}")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    engine_id = raw.get("engine_id")
    if engine_id is not None and (not isinstance(engine_id, str) or not 0 < len(engine_id) <= 256):
        raise ValueError("engine_id must be a string of 1 to 256 characters")
    if engine_id is None:
        return KVTransferConfig(connector, role, extra=extra)
    return KVTransferConfig(connector, role, engine_id, extra)
