"""Server settings: one ``Settings`` object, from command-line flags or ``SLOTSERVE_*`` variables.

Every field is a flag of ``slotserve serve`` (``num_slots`` -> ``--num-slots``) and an environment
variable (``SLOTSERVE_NUM_SLOTS``); a flag wins over the environment, which wins over the default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.keys import ApiKeys


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SLOTSERVE_",
        extra="ignore",
        hide_input_in_errors=True,  # keys never shown
    )

    host: str = Field("127.0.0.1", description="address to bind (0.0.0.0 in containers)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    num_slots: int = Field(32, ge=1, le=4096, description="batch slots: requests decoded at once")
    max_waiting: int = Field(1024, ge=0, description="waiting-queue bound; past it: 429")
    max_model_len: int = Field(8192, ge=2, description="context length: prompt + max_tokens")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request omits it")
    batching: Literal["continuous", "static"] = Field(
        "continuous", description="admission policy (static: only into an empty batch)"
    )
    model_name: str = Field("slotserve-mock", description="model id served and reported")
    model: Literal["mock", "cached-mock"] = Field(
        "cached-mock", description="built-in model: stateless mock or per-slot KV-cache mock"
    )
    mock_step_ms: float = Field(0.0, ge=0, description="simulated decode step latency (ms)")
    mock_per_seq_ms: float = Field(0.0, ge=0, description="extra step latency per sequence (ms)")
    mock_prefill_ms: float = Field(0.0, ge=0, description="extra latency per prompt token (ms)")
    mock_jitter: float = Field(0.0, ge=0, le=0.3, description="step latency std-dev / mean")
    mock_stop_probability: float = Field(
        0.01, ge=0, le=1, description="chance per token that the mock ends its output"
    )
    seed: int = Field(
        0, description="mock model seed (a request's seed field is accepted, not used)"
    )
    api_key: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="require 'Authorization: Bearer <key>': NAME:KEY or KEY (named default); "
        "repeatable; the variable takes a comma-separated list",
    )
    api_keys_file: Path | None = Field(None, description="file of NAME:KEY lines (# comments)")
    shutdown_grace: float = Field(10.0, ge=0, description="seconds in-flight streams may finish")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request body limit; past it: 413")
    max_header_bytes: int = Field(
        32 * 1024, ge=1024, le=1 << 20, description="request line + headers limit; past it: 431"
    )
    header_timeout: float = Field(10.0, gt=0, description="seconds to send the headers; then 408")
    max_connections: int = Field(
        0, ge=0, description="open connections past which requests get 503 (0: file limit - 128)"
    )
    send_timeout: float = Field(30.0, gt=0, description="seconds a slow reader may stall a send")
    sse_ping_seconds: float = Field(15.0, gt=0, description="SSE keep-alive comment interval")
    log_level: str = Field("info", description="uvicorn and slotserve log level")

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        return value.split(",") if isinstance(value, str) else value

    @field_validator("api_key", mode="after")
    @classmethod
    def _check_keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        ApiKeys.parse(key.get_secret_value() for key in keys)  # empty, non-ASCII, repeated
        return keys

    @model_validator(mode="after")
    def _check_all_keys(self) -> Settings:
        self.api_keys()  # the file's keys, and a name or key in both the flag and the file
        return self

    def api_keys(self) -> ApiKeys:
        """The named keys from ``api_key`` and ``api_keys_file`` (see ``app.keys``)."""
        entries = [key.get_secret_value() for key in self.api_key]
        return ApiKeys.parse(entries, self.api_keys_file)
