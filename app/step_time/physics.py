"""``PhysicsStepTime``: a step's duration from roofline terms, and vLLM's KV capacity.

For a step whose batch feeds ``T`` tokens (prefill chunk tokens plus one per decode) on one of
``P`` tensor-parallel GPUs (every figure below is per GPU: weights, heads and FLOPs split P
ways), the terms are:

- linear layers: ``max(FLOPs / peak FLOP/s, weight bytes / HBM bytes/s)``, where FLOPs are
  ``2 * active parameters * T`` plus the LM head for each sampled token, and the weights are
  read once per step (a mixture of experts reads the experts the step's tokens reach: with
  uniform routing ``E * (1 - (1 - k/E)^T)`` of its ``E``);
- attention: ``max(FLOPs / peak, KV bytes / HBM)``: a prefill chunk of ``c`` tokens after ``s``
  cached ones does ``4 * heads * head_dim * c * (s + (c + 1) / 2)`` FLOPs per layer and reads
  the ``s + c`` tokens' K and V; a decode reads its whole context's K and V;
- all-reduce (``P > 1``): two per layer, ring: ``latency + 2 (P-1)/P * T * hidden * 2 bytes /
  link bandwidth``;
- overheads: per layer (kernel launches and tails), per request in the batch (input
  preparation, sampling), per step (the scheduler and output processing between GPU steps).

``step = linear * t_linear + attention * t_attention + comm * t_allreduce + layer_s * L +
request_s * requests + step_s``: the first three constants correct the roofline (1.0: the
datasheet's peak), the rest are seconds. ``Calibration`` holds them with the time a request
spends before the queue (API, tokenization) and after its last token (detokenization, the
response); ``benchmarks/fidelity_real.py`` fits them on measured vLLM runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.step_clock import StepWork
from app.step_time.gpus import Gpu
from app.step_time.model_config import ModelShape

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory for weights, activations, KV
GIB = 1 << 30
NON_TORCH_BYTES = 1.5 * GIB  # CUDA graphs, NCCL buffers, the CUDA context (vLLM's estimate)
ALLREDUCES_PER_LAYER = 2  # after attention's output projection and after the MLP
ACTIVATION_BYTES = 2  # bf16 activations on the wire

NUM_BASIS = 6  # linear, attention, all-reduce, layers, requests, 1


@dataclass(frozen=True, slots=True)
class Calibration:
    """The constants fitted on measurements (see the module docstring for where each acts)."""

    linear: float = 1.0
    attention: float = 1.0
    comm: float = 1.0
    layer_us: float = 0.0
    request_us: float = 0.0
    step_us: float = 0.0
    allreduce_latency_us: float = 8.0  # one all-reduce's fixed cost (a prior, not fitted)
    api_ms: float = 0.0  # before the queue: HTTP, tokenization, hand-off to the engine
    post_ms: float = 0.0  # after the last token: detokenization, the response's end

    @property
    def coefficients(self) -> tuple[float, ...]:
        """The step time's weights of ``PhysicsStepTime.basis`` (seconds per unit)."""
        return (
            self.linear,
            self.attention,
            self.comm,
            self.layer_us * 1e-6,
            self.request_us * 1e-6,
            self.step_us * 1e-6,
        )


# Fitted by benchmarks/fidelity_real.py --fit on the shared vLLM H100 measurements (Llama-2-7B
# TP1, CodeLlama-34B TP2; docs/fidelity.md has the fit and its error).
DEFAULT_CALIBRATION = Calibration(
    linear=1.097,
    attention=1.094,
    comm=1.0,
    layer_us=7.58,
    request_us=20.76,
    step_us=1216.0,
    api_ms=6.905,
    post_ms=0.0,
)


class PhysicsStepTime:
    """A ``StepTimeModel``: ``model`` on ``tensor_parallel`` x ``gpu`` (see the module
    docstring). ``lora_load_s``: seconds a step pays per LoRA adapter it loads."""

    def __init__(
        self,
        model: ModelShape,
        gpu: Gpu,
        tensor_parallel: int = 1,
        calibration: Calibration = DEFAULT_CALIBRATION,
        lora_load_s: float = 0.0,
    ) -> None:
        model.check_tensor_parallel(tensor_parallel)
        self.model, self.gpu, self.tp = model, gpu, tensor_parallel
        self.calibration = calibration
        self.lora_load_s = lora_load_s
        p = tensor_parallel
        fp8 = model.dtype_bytes == 1 and gpu.fp8_tflops > 0
        self._flops = (gpu.fp8_tflops if fp8 else gpu.bf16_tflops) * 1e12
        self._bw = gpu.bytes_per_s
        lm_head = model.vocab * model.hidden
        # FLOPs per fed token and per sampled token; attention FLOPs per (query, key) pair
        self._token_flops = 2 * model.layers * model.active_layer_params / p
        self._sample_flops = 2 * lm_head / p
        self._pair_flops = 4 * model.layers * model.heads * model.head_dim / p
        self._kv_bytes = model.kv_bytes_per_token(p)
        self._dense_bytes = (
            (model.layers * model.attention_params + lm_head) * model.dtype_bytes / p
        )
        if model.moe:
            self._dense_bytes += model.layers * model.hidden * model.experts * model.dtype_bytes / p
            self._expert_bytes = model.layers * model.expert_params * model.dtype_bytes / p
        else:
            self._dense_bytes += model.layers * model.expert_params * model.dtype_bytes / p
            self._expert_bytes = 0.0
        allreduces = ALLREDUCES_PER_LAYER * model.layers if p > 1 else 0
        self._ar_fixed = allreduces * calibration.allreduce_latency_us * 1e-6
        ring = 2 * (p - 1) / p * model.hidden * ACTIVATION_BYTES / gpu.link_bytes_per_s
        self._ar_per_token = allreduces * ring
        self._coefficients = calibration.coefficients

    @property
    def enabled(self) -> bool:
        return True

    @property
    def host_seconds(self) -> float:
        return self.calibration.step_us * 1e-6

    def experts_reached(self, tokens: int) -> float:
        """Expected experts of one layer that ``tokens`` tokens route to (uniform routing)."""
        m = self.model
        if not m.moe or tokens <= 0:
            return 0.0
        return m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** tokens)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one GPU reads in a step feeding ``tokens`` tokens."""
        return self._dense_bytes + self._expert_bytes * self.experts_reached(tokens)

    def basis(self, work: StepWork) -> tuple[float, float, float, float, float, float]:
        """The step's terms before calibration: seconds of linear layers and of attention at
        the datasheet's peak, seconds of all-reduce, layers, requests in the batch, 1."""
        contexts = work.decode_contexts
        decodes = len(contexts)
        tokens = work.num_prefill_tokens + decodes
        context_sum = sum(contexts)
        pairs = float(context_sum)
        kv_tokens = context_sum
        for length, start in zip(work.prefill_lengths, work.prefill_starts, strict=True):
            pairs += length * (start + (length + 1) / 2)
            kv_tokens += start + length
        linear_flops = self._token_flops * tokens + self._sample_flops * work.sampled
        t_linear = max(linear_flops / self._flops, self.weight_bytes_read(tokens) / self._bw)
        t_attention = max(
            self._pair_flops * pairs / self._flops, self._kv_bytes * kv_tokens / self._bw
        )
        t_comm = self._ar_fixed + self._ar_per_token * tokens if self.tp > 1 else 0.0
        requests = decodes + len(work.prefill_lengths)
        return (t_linear, t_attention, t_comm, float(self.model.layers), float(requests), 1.0)

    def seconds(self, work: StepWork) -> float:
        if not work.decode_contexts and not work.prefill_lengths:
            return 0.0
        c = self._coefficients
        b = self.basis(work)  # (summed term by term, in one order: the same float on every Python)
        total = c[0] * b[0] + c[1] * b[1] + c[2] * b[2] + c[3] * b[3] + c[4] * b[4] + c[5]
        return total + self.lora_load_s * work.lora_loads


def kv_cache_tokens(
    model: ModelShape,
    gpu: Gpu,
    tensor_parallel: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    utilization: float = GPU_MEMORY_UTILIZATION,
) -> int:
    """The KV capacity (tokens) vLLM would get: on each GPU, ``utilization`` of its memory
    less its share of the weights and an activation reserve (a forward pass of
    ``max_num_batched_tokens`` tokens: the MLP's and attention's intermediate tensors, the
    logits of ``max_num_seqs`` rows in fp32, and ``NON_TORCH_BYTES``), divided by the KV bytes
    one token takes on one GPU. GPU memory counts binary gigabytes (an "80 GB" H100 has 80
    GiB). Never below zero."""
    p = tensor_parallel
    memory = gpu.memory_gb * GIB
    weights = model.weight_bytes / p
    mlp = model.intermediate * (model.experts_per_token or 1)
    per_token = (4 * model.hidden + 2 * mlp) / p * ACTIVATION_BYTES
    activations = max_num_batched_tokens * per_token + max_num_seqs * model.vocab * 4
    free = utilization * memory - weights - activations - NON_TORCH_BYTES
    return max(0, int(free // model.kv_bytes_per_token(p)))


def require_kv_room(
    tokens: int,
    block_size: int,
    model: ModelShape,
    gpu: Gpu,
    tensor_parallel: int,
    utilization: float = GPU_MEMORY_UTILIZATION,
) -> None:
    """``ValueError`` if ``tokens`` of KV capacity (``kv_cache_tokens``) cannot serve ``model``:
    fewer than one ``block_size`` block; the line names the model, the GPU's memory and the
    tensor-parallel size."""
    if tokens >= block_size:
        return
    per_gpu = model.weight_bytes / tensor_parallel / GIB
    raise ValueError(
        f"no room for a KV cache: {model.name}'s weights take {per_gpu:.1f} GiB on each of "
        f"{tensor_parallel} x {gpu.name} ({gpu.memory_gb:g} GiB each, {utilization:.0%} "
        f"usable), leaving {tokens} KV tokens, less than one {block_size}-token block; try "
        f"a larger --tensor-parallel-size (now {tensor_parallel})"
    )
