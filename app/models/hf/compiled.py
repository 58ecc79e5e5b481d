"""The compiled forward (``--compile auto``): each decoder layer (``llama.block``) through
``torch.compile`` (inductor's C++ backend), one graph shared by all layers, the token dimension
dynamic.

What the compiler sees and what it does not:

- It fuses the elementwise work between the matrix products (RMSNorm in float32, RoPE, the
  residual adds, SiLU-mul, the casts) into a few C++ loops per layer.
- The matrix products keep ``Linear``'s kernels (``linear.product``), the layer's weights
  being graph inputs: torch's int8/int4 kernels and ``F.linear`` are called from the graph
  directly; oneDNN's prepacked bf16 product is an opaque custom op
  (``slotserve::packed_linear``), since inductor lowers that op only for a constant weight.
- The cache write and the attention stay ``llama.write_and_attend`` (an opaque custom op,
  ``slotserve::attend``): the step's ``StepLayout`` (Python ints and per-chunk masks) is not
  traced, so one graph serves every batch size and context length. The cache tensors are
  written in place (no reallocation). The op finds its layer by a 0-d tensor handle
  (``_LAYERS``), so the 30 layers share one graph instead of compiling 30.

Two graphs (one token; n >= 2 tokens, dynamic) are built ahead of time with torch's
``aot_compile`` (``CompiledForward.build``) and saved in the model's cache folder, keyed by
torch's version, the layer's shapes and kinds, the thread count, the CPU's vector instructions
and this code; a later start loads them instead of tracing again (a read-only folder: loaded,
or compiled and not saved). A step calls them directly: no dynamo frame hook and no guards
(``_layer`` picks the graph by token count). Inductor's own caches sit beside them
(``use_cache_folder``). Figures and the decisions behind this layout: docs/benchmarks.md,
"Compiled forward".
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.models.hf.attention import StepLayout
from app.models.hf.config import ArchConfig
from app.models.hf.linear import product
from app.models.hf.llama import LayerWeights, LlamaForward, block, write_and_attend

log = logging.getLogger("slotserve.model")

WHICH = ("qkv", "out", "gate_up", "down")
TRACED_MODULES = ("attention", "compiled", "linear", "llama", "rope")  # a saved graph's source

# A layer handle's forward and layer index; entries live as long as the process (a server
# loads one model; a test process a few tiny ones).
_LAYERS: list[tuple[CompiledForward, int]] = []
_REGISTRY_LOCK = threading.Lock()


def compiler() -> str | None:
    """The C++ compiler inductor will use, or None: the first of inductor's candidates
    (``cpp.cxx``: ``$CXX`` if set, else ``g++``) found on the PATH. Another compiler on the
    PATH (``c++``, ``clang++``) is not one inductor would call."""
    from torch._inductor import config

    for name in config.cpp.cxx:
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
        with contextlib.suppress(OSError):  # a read-only parent: checked below
            folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):  # inductor locks and writes files there
            log.warning("%s is not writable: inductor's caches stay in its default", folder)
            return
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


@torch.library.custom_op("slotserve::packed_linear", mutates_args=())
def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return product("packed", x, weight, None, bias)


@_packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


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
    by every layer (the layer's tensors are its inputs; the attention op finds the layer by a
    0-d tensor handle), two graphs in all (one token; several), built by ``build`` before the
    first step. Same inputs and results as the eager forward up to float rounding
    (tests/models/test_hf_compile.py)."""

    def __init__(self, eager: LlamaForward, folder: Path) -> None:
        super().__init__(eager.arch, eager.weights, eager.rope, eager.cache)
        self.layout: StepLayout | None = None
        self.folder = folder
        with _REGISTRY_LOCK:
            first = len(_LAYERS)
            _LAYERS.extend((self, i) for i in range(len(self.weights.layers)))
        self._handles = [torch.tensor(first + i) for i in range(len(self.weights.layers))]
        kinds = [{name: getattr(y, name).kind for name in WHICH} for y in self.weights.layers]
        self._kinds = kinds[0]
        if any(k != self._kinds for k in kinds):
            raise ValueError("the compiled forward needs every layer's matrices stored alike")
        self._graphs: dict[bool, Callable[..., torch.Tensor]] = {}  # one token? -> graph

    def __call__(
        self, tokens: torch.Tensor, layout: StepLayout, logit_rows: torch.Tensor
    ) -> torch.Tensor:
        self.layout = layout  # read by slotserve::attend, never traced
        try:
            return super().__call__(tokens, layout, logit_rows)
        finally:
            self.layout = None

    def build(self, tokens: int) -> bool:
        """Makes the graph for ``tokens`` (1: the one-token graph; 2: every count above 1):
        loaded from ``folder`` if a start compiled it before (same torch, shapes and source
        code), else compiled and saved there. Returns whether it was loaded."""
        device = self.weights.embed.device
        positions = torch.arange(tokens, device=device)
        inputs = self._inputs(0, self.weights.embed[positions], *self.rope.tables(positions))
        path = self.folder / f"layer-{self._key(inputs, tokens)}-{'1' if tokens == 1 else 'n'}.bin"
        graph: Any = None
        if path.is_file():
            try:
                with path.open("rb") as file:
                    graph = torch.compiler.load_compiled_function(file, f_globals=globals())
            except Exception as exc:  # any unreadable artifact: compile it again
                log.warning("compiled layer %s unusable (%s): compiling it again", path, exc)
        loaded = graph is not None
        if not loaded:
            traced = _layer_function(dataclasses.replace(self.arch, hf_config=None), self._kinds)
            options: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
            if tokens == 1:  # one row's loops are too small to share: no OpenMP region to wake
                options["cpp.threads"] = 1
            compiling: Any = torch.compile(  # no guards: ``_layer`` picks the graph itself
                traced, dynamic=True, fullgraph=True, options=options
            )
            graph = compiling.aot_compile((inputs, {}))
            self._save(graph, path)
        graph.disable_guard_check()  # it has none: ``_layer`` picks the graph by token count
        self._graphs[tokens == 1] = graph
        return loaded

    def _save(self, graph: Any, path: Path) -> None:
        """Writes ``graph`` to ``path`` (torch writes a temporary file and renames it, so a
        reader never sees half a file); a folder it cannot write only costs the next start a
        compile."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(path))
        except Exception as exc:  # the graph in hand still runs
            log.warning("compiled layer not saved (%s): the next start compiles it again", exc)

    def _key(self, inputs: tuple[torch.Tensor | None, ...], tokens: int) -> str:
        """What a saved graph depends on: torch's version, the layer's shapes, dtypes and
        matrix kinds, the thread count it is built for (1 for the one-token graph, else
        torch's), the CPU's vector instruction set (the kernels are built for it) and the source
        of the modules traced into it."""
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        arch = dataclasses.replace(self.arch, hf_config=None, num_layers=0, vocab_size=0)
        shapes = [None if t is None else (tuple(t.shape), t.dtype) for t in inputs]
        parts = [torch.__version__, repr(arch), repr(shapes), repr(self._kinds)]
        threads = 1 if tokens == 1 else torch.get_num_threads()  # inductor plans loops by it
        parts.append(f"{threads} threads")
        parts.append(str(pick_vec_isa()))  # its kernels' instructions (a shared cache folder)
        for name in TRACED_MODULES:
            parts.append(inspect.getsource(sys.modules[f"app.models.hf.{name}"]))
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def _inputs(
        self, index: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """Layer ``index``'s graph inputs: ``_traced``'s arguments."""
        layer = self.weights.layers[index]
        matrices = [t for name in WHICH for t in getattr(layer, name).tensors()]
        return (self._handles[index], layer.input_norm, layer.post_norm, hidden, cos, sin,
                *matrices)  # fmt: skip

    def _layer(
        self,
        index: int,
        layer: LayerWeights,
        hidden: torch.Tensor,
        layout: StepLayout,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        graph = self._graphs[hidden.shape[0] == 1]
        return graph(*self._inputs(index, hidden, cos, sin))


def _layer_function(arch: ArchConfig, kinds: dict[str, str]) -> Callable[..., torch.Tensor]:
    """The function ``torch.compile`` traces: ``llama.block`` over a layer's tensors (its
    arguments; ``CompiledForward._inputs``), the matrices applied as ``kinds`` says. It closes
    over ``arch`` and ``kinds`` only (both picklable: the compiled graph is saved with them)."""

    def layer(
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
            weight, scales, bias = matrices[i : i + 3]
            assert weight is not None
            if kinds[name] == "packed":  # oneDNN's call stays opaque (see the module doc)
                out: torch.Tensor = torch.ops.slotserve.packed_linear(x, weight, bias)
                return out
            return product(kinds[name], x, weight, scales, bias)

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = torch.ops.slotserve.attend(q, k, v, handle)
            return out

        return block(arch, input_norm, post_norm, hidden, cos, sin, linear, attention)

    return layer


def warm_up(forward: CompiledForward) -> float:
    """Builds the decoder layer's two graphs (``CompiledForward.build``: one token; any other
    count) and runs a step of each size on slot 0, which it leaves empty. Logs each graph's
    time and whether it came from the cache; returns the total seconds."""
    began = time.perf_counter()
    device = forward.weights.embed.device
    for tokens in (1, 2):
        t0 = time.perf_counter()
        loaded = forward.build(tokens)
        layout = StepLayout.build([], [], [(0, 0, tokens)], device)
        with torch.inference_mode():
            forward(torch.zeros(tokens, dtype=torch.long, device=device), layout,
                    torch.tensor([tokens - 1], device=device))  # fmt: skip
        log.info(
            "%s the decoder layer for %s: %.1f s (in %s)",
            "loaded" if loaded else "compiled",
            "1 token" if tokens == 1 else "n tokens (dynamic)",
            time.perf_counter() - t0,
            forward.folder,
        )
    forward.cache.lengths[0] = 0
    return time.perf_counter() - began
