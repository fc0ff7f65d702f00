"""What the GPU benchmarks share, standard library only (a bare GPU machine has no pydantic
until the vLLM bundle is staged): percentiles, a hard wall-clock limit, and importing
single engine modules without voicebot/engines/__init__.py."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def bare_engines_package() -> None:
    """Put the repo on sys.path and let ``voicebot.engines.X`` import without the package's
    ``__init__`` (which imports the whole ASR/LLM/VAD stack)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if "voicebot.engines" not in sys.modules:
        pkg = types.ModuleType("voicebot.engines")
        pkg.__path__ = [str(ROOT / "voicebot" / "engines")]
        sys.modules["voicebot.engines"] = pkg


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarise(values_s: list[float], digits: int = 1) -> dict[str, Any]:
    """Seconds in, a millisecond summary out, rounded to ``digits`` decimals."""
    ms = [x * 1000.0 for x in values_s]
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "p50": round(pct(ms, 50) or 0, digits), "p95": round(pct(ms, 95) or 0, digits),
            "p99": round(pct(ms, 99) or 0, digits), "mean": round(sum(ms) / len(ms), digits),
            "max": round(max(ms), digits)}


def run_with_deadline(coro: Any, max_wall_s: float, name: str) -> Any:
    """asyncio.run(coro), but the process exits (code 3) after ``max_wall_s``: a device
    call must end inside its limit even when an engine hangs in a thread."""

    def hard_stop() -> None:
        print(f"[{name}] --max-wall-s {max_wall_s} reached: exiting", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(max_wall_s, hard_stop)
    timer.daemon = True
    timer.start()
    try:
        return asyncio.run(coro)
    finally:
        timer.cancel()
