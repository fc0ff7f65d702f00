"""What every benchmark shares, standard library only (a bare GPU machine has no pydantic
until vLLM is installed): the one JSON shape of results, percentiles and millisecond
summaries, a hard wall-clock limit, and importing single engine modules without
voicebot/engines/__init__.py.

Every benchmark writes its ``--json`` file as::

    {"benchmark": "engines", "date": "2026-11-28T12:00:00Z",
     "host": {"hostname", "os", "python", "cpu", "cpus", "gpus"},
     "config": "configs/default.yaml" | null, "args": {...the command line's values...},
     "results": {...what the benchmark measured...}}

with every latency in ``results`` summarised as ``{"n", "p50", "p95", "p99", "mean", "max"}``
in milliseconds (:func:`summarise_ms`). :func:`results_of` reads such a file back (or an
older file without the envelope).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The end of every benchmark's --help: what its --json file holds.
JSON_EPILOG = ("Results (the --json file, or the .json files of --out): the one shape of benchmarks/bench_util.py, "
               "{benchmark, date, host, config, args, results}, every latency in results as "
               "{n, p50, p95, p99, mean, max} in ms. benchmarks/README.md lists every benchmark and its command.")


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
    """The ``p``-th percentile (0-100), linear between the two nearest ranks (numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarise(values_s: list[float], digits: int = 1) -> dict[str, Any]:
    """Seconds in, a millisecond summary out, rounded to ``digits`` decimals."""
    return summarise_ms([x * 1000.0 for x in values_s], digits)


def summarise_ms(values_ms: Any, digits: int = 1) -> dict[str, Any]:
    """Milliseconds in (any iterable; None left out): ``{"n", "p50", "p95", "p99", "mean", "max"}``."""
    ms = [float(x) for x in values_ms if x is not None]
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "p50": round(pct(ms, 50) or 0, digits), "p95": round(pct(ms, 95) or 0, digits),
            "p99": round(pct(ms, 99) or 0, digits), "mean": round(sum(ms) / len(ms), digits),
            "max": round(max(ms), digits)}


def cpu_busy_total(times: Any) -> tuple[float, float]:
    """(busy, total) CPU seconds of ``psutil.cpu_times()`` (all cores): idle and iowait are
    not busy; guest time is already within user."""
    busy = times.user + times.nice + times.system + times.irq + times.softirq + getattr(times, "steal", 0.0)
    return busy, busy + times.idle + getattr(times, "iowait", 0.0)


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


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def host() -> dict[str, Any]:
    """The machine a result was measured on: figures of different machines are not compared."""
    return {"hostname": platform.node(), "os": platform.platform(), "python": platform.python_version(),
            "cpu": _cpu_model(), "cpus": os.cpu_count(), "gpus": _gpus()}


def envelope(benchmark: str, args: argparse.Namespace | dict[str, Any] | None, results: Any,
             config: str | None = None) -> dict[str, Any]:
    """The one JSON shape of every benchmark's results (the module docstring)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    if config is None and values.get("config") is not None:
        config = str(values["config"])
    return {"benchmark": benchmark, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": host(), "config": config, "args": json.loads(json.dumps(values, default=str)),
            "results": results}


def write_result(path: str | Path | None, benchmark: str, args: argparse.Namespace | dict[str, Any] | None,
                 results: Any, config: str | None = None) -> None:
    """Write ``results`` in the one JSON shape to ``path`` (nothing when ``path`` is None)."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(envelope(benchmark, args, results, config), indent=1, default=str) + "\n")


def results_of(doc: Any) -> Any:
    """The ``results`` of a file in the one JSON shape, or the whole of an older file."""
    if isinstance(doc, dict) and "benchmark" in doc and "results" in doc:
        return doc["results"]
    return doc
