"""--dtype auto: bfloat16 only where the CPU computes it (AVX512-BF16 or AMX), float32 elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.dtype_choice import choose_dtype, cpu_flags

EPYC_ZEN4 = frozenset({"avx512f", "avx512_bf16", "avx2"})
XEON_AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
XEON_AVX512_ONLY = frozenset({"avx512f", "avx512bw", "avx2"})  # issue 30's third kind of host
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("flags, dtype, named", [
    (EPYC_ZEN4, "bfloat16", "avx512_bf16"),
    (XEON_AMX, "bfloat16", "avx512_bf16, amx_bf16"),
    (XEON_AVX512_ONLY, "float32", "emulated"),
    (AVX2, "float32", "emulated"),
    (frozenset(), "float32", "emulated"),
])
def test_auto_follows_the_cpu_and_says_why(flags: frozenset[str], dtype: str, named: str) -> None:
    choice = choose_dtype("auto", flags)
    assert choice.dtype == dtype and named in choice.reason and choice.reason.startswith("auto")


def test_an_explicit_dtype_is_kept_whatever_the_cpu() -> None:
    assert choose_dtype("bfloat16", AVX2).dtype == "bfloat16"
    assert choose_dtype("float32", XEON_AMX).dtype == "float32"
    with pytest.raises(ValueError, match="float16.*auto, bfloat16, float32"):
        choose_dtype("float16")


def test_cpu_flags_come_from_the_first_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
