"""Cap the OpenMP threads of this process and of the engine processes it starts.

On a GPU host the server and the ASR service need no CPU math from torch, yet torch
(and the vLLM engine core it forks, which inherits the environment) sizes its OpenMP
pool to every core, and idle OpenMP workers spin before they sleep: on a many-core GPU
host the shared Whisper service's engine core took cores from the frontends and slowed
the ASR final (docs/gpu-results.md, 'Threads that spin'). On a CPU host vLLM-CPU and CTranslate2 do their math on these
threads, so the default (0) leaves them alone.

``OMP_WAIT_POLICY`` decides what an idle OpenMP worker does: spin for a while (libgomp's
default) or sleep at once (PASSIVE). On 2 cores the ASR's CTranslate2 pool
and the LLM's torch pool take turns on the same cores, and a spinning worker of one holds a
core the other is waiting for (docs/benchmarks.md, 'Why the defaults are what they are').
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def limit_omp_threads(n: int) -> None:
    """``OMP_NUM_THREADS=n`` for this process and its children; 0 changes nothing.

    Call it before the engines start: OpenMP reads the variable when its runtime starts.
    If torch is already imported its pool is resized as well."""
    if n <= 0:
        return
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    if before not in (None, str(n)):
        log.info("OMP_NUM_THREADS %s -> %d (server.omp_threads)", before, n)


def set_omp_wait_policy(policy: str) -> None:
    """``OMP_WAIT_POLICY`` for this process and its children; "" changes nothing.

    OpenMP runtimes read it once, when they load: call it before the engines import
    CTranslate2 or torch. If one is loaded already, only the engine processes started from
    now on get it, and the log says so."""
    if not policy:
        return
    value = policy.upper()
    before = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = value
    if before not in (None, value):
        log.info("OMP_WAIT_POLICY %s -> %s (server.omp_wait_policy)", before, value)
    loaded = openmp_runtimes_loaded()
    if loaded:
        log.warning(
            "server.omp_wait_policy=%s comes too late for this process (%s already loaded, "
            "LD_PRELOAD?); engine processes started from now on get it. Set OMP_WAIT_POLICY "
            "in the environment to cover this process too",
            policy,
            ", ".join(loaded),
        )


def openmp_runtimes_loaded() -> list[str]:
    """The OpenMP runtimes mapped into this process (libgomp, Intel's libiomp, LLVM's libomp)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to say
        return []
    names = {line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/" in line}
    return sorted(n for n in names if n.startswith(("libgomp", "libiomp", "libomp")))
