"""llm.dtype auto: float32 on a CPU without native bf16, bfloat16 with it, vLLM's choice on a GPU."""

from __future__ import annotations

from pathlib import Path

from voicebot.config import Config
from voicebot.engines.llm.dtype import cpu_flags, resolve_dtype

AVX2_ONLY = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})


def test_auto_on_a_cpu_without_native_bf16_is_float32() -> None:
    assert resolve_dtype("auto", on_cpu=True, flags=AVX2_ONLY) == "float32"


def test_auto_on_a_cpu_with_native_bf16_is_bfloat16() -> None:
    assert resolve_dtype("auto", on_cpu=True, flags=AVX2_ONLY | {"avx512f", "avx512_bf16"}) == "bfloat16"
    assert resolve_dtype("auto", on_cpu=True, flags=AVX2_ONLY | {"amx_bf16"}) == "bfloat16"


def test_auto_on_a_gpu_and_explicit_dtypes_pass_through() -> None:
    assert resolve_dtype("auto", on_cpu=False, flags=AVX2_ONLY) == "auto"
    assert resolve_dtype("bfloat16", on_cpu=True, flags=AVX2_ONLY) == "bfloat16"
    assert resolve_dtype("float16", on_cpu=False) == "float16"


def test_cpu_flags_reads_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_the_default_is_auto() -> None:
    assert Config().llm.dtype == "auto"
