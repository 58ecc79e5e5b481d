"""How long the prompt's KV takes to cross from the producer to the consumer."""

from __future__ import annotations

from dataclasses import dataclass

# Llama-3.1-8B's KV per token (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes), used when
# neither a GPU profile nor --model-config says what the model is.
DEFAULT_KV_BYTES_PER_TOKEN = 131_072
DEFAULT_BANDWIDTH_GBPS = 50.0  # GB/s: one 400 Gb/s NIC (InfiniBand NDR / RoCE), as NIXL uses
DEFAULT_LATENCY_MS = 1.0  # a transfer's fixed cost: handshake, descriptor exchange, completion


@dataclass(frozen=True, slots=True)
class Link:
    """The link between producer and consumer, and the model's KV bytes per token."""

    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    latency_ms: float = DEFAULT_LATENCY_MS

    def seconds(self, num_tokens: int) -> float:
        """The transfer time of ``num_tokens`` tokens' KV."""
        return self.latency_ms / 1e3 + num_tokens * self.kv_bytes_per_token / (
            self.bandwidth_gbps * 1e9
        )
