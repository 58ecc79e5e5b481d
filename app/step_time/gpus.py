"""Datasheet figures of the GPUs ``--gpu`` knows.

FLOPs are dense tensor-core figures (vendors quote bf16/fp8 with 2:4 sparsity: twice these).
Memory sizes and bandwidths are decimal (80 GB = 80e9 bytes; 3.35 TB/s = 3.35e12 bytes/s).
``link_gb_s`` is the GPU-to-GPU bandwidth one GPU has for tensor-parallel all-reduces, per
direction (NVLink, or PCIe where the card has no NVLink).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense (0: no fp8 tensor cores; bf16 is used)
    hbm_tb_s: float
    memory_gb: float
    link_gb_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_tb_s * 1e12

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gb_s * 1e9


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        # NVIDIA datasheets (H100: 2430615; H200; A100: 1758950; L40S; B200/HGX B200).
        # NVLink figures are per GPU, one direction (half the bidirectional total).
        Gpu("h100-sxm", 989.4, 1978.9, 3.35, 80, 450),
        Gpu("h100-pcie", 756.0, 1513.0, 2.0, 80, 300),  # NVLink bridge (600 GB/s bidir.)
        Gpu("h100-nvl", 835.0, 1670.0, 3.9, 94, 300),
        Gpu("h200", 989.4, 1978.9, 4.8, 141, 450),
        Gpu("a100-80gb", 312.0, 0.0, 2.039, 80, 300),
        Gpu("a100-40gb", 312.0, 0.0, 1.555, 40, 300),
        Gpu("l40s", 362.05, 733.0, 0.864, 48, 32),  # no NVLink: PCIe Gen4 x16
        Gpu("b200", 2250.0, 4500.0, 8.0, 180, 900),
    )
}


class UnknownGpuError(ValueError):
    """``--gpu`` names no GPU of the table."""


def gpu(name: str) -> Gpu:
    """The GPU called ``name`` (case and ``_``/space insensitive); ``UnknownGpuError`` lists
    the known ones."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key not in GPUS:
        raise UnknownGpuError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]
