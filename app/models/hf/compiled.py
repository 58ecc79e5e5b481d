"""The compiled forward (``--compile auto``): each decoder layer (``llama.block``) through
``torch.compile`` (inductor's C++ backend), one graph shared by all layers, the token dimension
dynamic.

What the compiler sees and what it does not:

- It fuses the elementwise work between the matrix products (RMSNorm in float32, RoPE, the
  residual adds, SiLU-mul, the casts) into a few C++ loops per layer.
- The matrix products stay ``Linear``'s own kernels (oneDNN's prepacked bf16 weight, torch's
  int8/int4 kernels): each is an opaque custom op (``slotserve::linear``), so inductor neither
  re-lays out weights nor loses the prepacking.
- The cache write and the attention stay ``llama.write_and_attend`` (an opaque custom op,
  ``slotserve::attend``): the step's ``StepLayout`` (Python ints and per-chunk masks) is not
  traced, so one graph serves every batch size and context length. The cache tensors are
  written in place (no reallocation).
- The layer reaches both ops as a 0-d tensor handle (``_LAYERS``), not a constant, so the 30
  layers share one graph instead of compiling 30.

Shapes: dynamo specializes a size of 1 on its own, so a start compiles two graphs (one token;
n tokens), both run by ``warm_up`` before the model is served. Inductor caches its compiled code
on disk (``use_cache_folder``: under the model's cache folder); a second start reuses it.
Figures and the decisions behind this layout: docs/benchmarks.md, "Compiled forward".
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from app.models.hf.attention import StepLayout
from app.models.hf.linear import product
from app.models.hf.llama import LayerWeights, LlamaForward, block, write_and_attend

log = logging.getLogger("slotserve.model")

RECOMPILE_LIMIT = 64  # graphs per process (a test suite loads many model shapes)
WHICH = ("qkv", "out", "gate_up", "down")

# A layer handle's forward and layer index; entries live as long as the process (a server
# loads one model; a test process a few tiny ones).
_LAYERS: list[tuple[CompiledForward, int]] = []
_REGISTRY_LOCK = threading.Lock()


def compiler() -> str | None:
    """The C++ compiler inductor would use (``$CXX``, else ``c++``/``g++``/``clang++`` on the
    PATH), or None."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (found := shutil.which(name)):
            return found
    return None


def resolve(mode: str, device: str) -> tuple[bool, str]:
    """``(compile, why)`` for ``--compile``: ``off`` never; ``auto`` on a CPU where a C++
    compiler is present. ``why`` is one line for the start log."""
    if mode == "off":
        return False, "--compile off"
    if device != "cpu":
        return False, f"auto: eager on {device} (the compiled path is CPU only)"
    found = compiler()
    if found is None:
        return False, "auto: no C++ compiler on the PATH (set CXX or install g++): eager"
    return True, f"auto: C++ compiler {found}"


def use_cache_folder(folder: Path) -> None:
    """Points inductor's on-disk caches (FX graph, AOTAutograd, kernels) at ``folder``, unless
    ``TORCHINDUCTOR_CACHE_DIR`` names a folder of the user's (inductor itself fills the variable
    with its default, under /tmp, the first time it asks)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == default_cache_dir():
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def _packed_product_as_call() -> None:
    """Makes inductor emit oneDNN's prepacked product (``mkldnn._linear_pointwise``) as a
    direct call on whatever weight the graph is given. Its own lowering takes the weight only
    as a constant (a frozen model), which would bake each layer's weights into its own graph;
    with a plain call one graph serves all layers, and inductor still folds a following SiLU
    into the call as oneDNN's post-op."""
    from torch._inductor import lowering

    op = torch.ops.mkldnn._linear_pointwise.default
    if op not in lowering.fallbacks:
        lowering.lowerings.pop(op, None)
        lowering.make_fallback(op)


@torch.library.custom_op("slotserve::attend", mutates_args=())
def _attend_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    forward, index = _LAYERS[int(layer)]
    assert forward.layout is not None
    return write_and_attend(forward.cache, index, q, k, v, forward.layout)


@_attend_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class CompiledForward(LlamaForward):
    """``LlamaForward`` whose decoder layer (``llama.block``) runs compiled: one graph shared
    by every layer, the layer named to the opaque ops by a 0-d tensor handle rather than a
    constant baked into the graph, so a start compiles two graphs (one token; several). Same
    inputs and results as the eager forward up to float rounding (tests/test_hf_compile.py)."""

    def __init__(self, eager: LlamaForward) -> None:
        super().__init__(eager.arch, eager.weights, eager.rope, eager.cache)
        self.layout: StepLayout | None = None
        with _REGISTRY_LOCK:
            first = len(_LAYERS)
            _LAYERS.extend((self, i) for i in range(len(self.weights.layers)))
        self._handles = [torch.tensor(first + i) for i in range(len(self.weights.layers))]
        kinds = [{name: getattr(y, name).kind for name in WHICH} for y in self.weights.layers]
        self._kinds = kinds[0]
        if any(k != self._kinds for k in kinds):
            raise ValueError("the compiled forward needs every layer's matrices stored alike")
        _packed_product_as_call()
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        dynamo.fail_on_recompile_limit_hit = True  # never a silent fall back to eager
        self._compiled = torch.compile(self._traced, dynamic=True, fullgraph=True)

    def __call__(
        self, tokens: torch.Tensor, layout: StepLayout, logit_rows: torch.Tensor
    ) -> torch.Tensor:
        self.layout = layout  # read by slotserve::attend, never traced
        try:
            return super().__call__(tokens, layout, logit_rows)
        finally:
            self.layout = None

    def _layer(
        self,
        index: int,
        layer: LayerWeights,
        hidden: torch.Tensor,
        layout: StepLayout,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        matrices = [t for name in WHICH for t in getattr(layer, name).tensors()]
        out: torch.Tensor = self._compiled(
            self._handles[index], layer.input_norm, layer.post_norm, hidden, cos, sin, *matrices
        )
        return out

    def _traced(
        self,
        handle: torch.Tensor,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *matrices: torch.Tensor | None,
    ) -> torch.Tensor:
        def linear(name: str, x: torch.Tensor) -> torch.Tensor:
            i = WHICH.index(name) * 3
            weight = matrices[i]
            assert weight is not None
            return product(self._kinds[name], x, weight, matrices[i + 1], matrices[i + 2])

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = torch.ops.slotserve.attend(q, k, v, handle)
            return out

        return block(self, input_norm, post_norm, hidden, cos, sin, linear, attention)


def warm_up(forward: CompiledForward) -> float:
    """Compiles the decoder layer's two graphs (one token: a lone decode step; any other
    count: dynamic) by running a step of each size on slot 0, which it leaves empty. Logs
    each graph's time and returns the total seconds."""
    began = time.perf_counter()
    device = forward.weights.embed.device
    for tokens in (1, 2):
        layout = StepLayout.build([], [], [(0, 0, tokens)], device)
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            forward(ids, layout, torch.tensor([tokens - 1], device=device))
        log.info(
            "compiled the decoder layer for %s: %.1f s (inductor cache: %s)",
            "1 token" if tokens == 1 else "n tokens (dynamic)",
            time.perf_counter() - t0,
            os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default"),
        )
    forward.cache.lengths[0] = 0
    return time.perf_counter() - began
