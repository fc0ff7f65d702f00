"""The LLM's dtype when the config says ``auto``.

On a CPU, vLLM runs bfloat16 fast only where the CPU has it natively (AVX512-BF16 or
AMX); elsewhere (AVX2 machines: most laptops, many cloud cores) every bf16 matmul is
converted on the fly, so float32 prefills several times faster there, for a slower
decode of a single stream (weights twice the bytes; docs/benchmarks.md, 'Why the
defaults are what they are'). On a GPU, ``auto`` is
left to vLLM (the model's own dtype).
"""

from __future__ import annotations

from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags; empty where /proc/cpuinfo does not exist."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def resolve_dtype(dtype: str, *, on_cpu: bool, flags: frozenset[str] | None = None) -> str:
    """``dtype`` as vLLM should get it: ``auto`` on a CPU becomes bfloat16 with native
    support, float32 without; anything else is passed through."""
    if dtype != "auto" or not on_cpu:
        return dtype
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags & NATIVE_BF16_FLAGS else "float32"
