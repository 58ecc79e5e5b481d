"""``--dtype auto``: bfloat16 only where the CPU computes it natively; an explicit dtype wins."""

from __future__ import annotations

from pathlib import Path

from app.models.hf.dtype import cpu_flags, resolve_dtype


def test_auto_picks_bfloat16_only_with_native_support() -> None:
    assert resolve_dtype("auto", "cpu", frozenset({"avx512f", "avx512_bf16"}))[0] == "bfloat16"
    assert resolve_dtype("auto", "cpu", frozenset({"amx_bf16", "amx_tile"}))[0] == "bfloat16"
    assert resolve_dtype("auto", "cpu", frozenset({"avx512f", "avx2"})) == (
        "float32",
        "auto: no native bfloat16 on this device (AVX-512 BF16 or AMX)",
    )
    assert resolve_dtype("float32", "cpu", frozenset({"avx512_bf16"})) == ("float32", "--dtype")
    assert resolve_dtype("bfloat16", "cpu", frozenset()) == ("bfloat16", "--dtype")


def test_cpu_flags_read_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512_bf16 sse\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx512_bf16", "sse"})
    assert cpu_flags(tmp_path / "missing") == frozenset()
