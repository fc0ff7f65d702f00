"""Cap the OpenMP threads of this process and of the engine processes it starts.

On a GPU host the server and the ASR service need no CPU math from torch, yet torch
(and the vLLM engine core it forks, which inherits the environment) sizes its OpenMP
pool to every core, and idle OpenMP workers spin before they sleep. Measured on a
16-core H100 host (docs/gpu-results.md, 2026-11-24): the shared Whisper service's
engine core kept 15 such threads at 12-23% of a core each; with ``OMP_NUM_THREADS=1``
the service used 0.74 cores instead of 2.03 at 32 callers and the ASR final p95 fell
from 874 to 640 ms. On a CPU host vLLM-CPU and CTranslate2 do their math on these
threads, so the default (0) leaves them alone.
"""

from __future__ import annotations

import logging
import os
import sys

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
