"""The dtype a real model runs in when the user did not choose one (``--dtype auto``): bfloat16
where the hardware computes it natively (a CPU with AVX-512 BF16 or AMX, a CUDA device that
supports it), float32 elsewhere (emulated bfloat16 is slower than float32)."""

from __future__ import annotations

from pathlib import Path

NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def resolve_dtype(name: str, device: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """``(dtype, why)``: ``name`` itself unless it is ``auto``; then bfloat16 on a CPU whose
    ``flags`` (default: this machine's) include native bf16 or a CUDA device that supports it,
    else float32. ``why`` is one line for the start log."""
    if name != "auto":
        return name, "--dtype"
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: the CUDA device supports bfloat16"
        return "float32", "auto: no bfloat16 support on the CUDA device"
    native = sorted(NATIVE_BF16_CPU_FLAGS & (cpu_flags() if flags is None else flags))
    if device == "cpu" and native:
        return "bfloat16", f"auto: the CPU has native bfloat16 ({', '.join(native)})"
    return "float32", "auto: no native bfloat16 on this device (AVX-512 BF16 or AMX)"
