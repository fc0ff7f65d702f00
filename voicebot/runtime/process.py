"""Process-wide settings, made once at start-up by `voicebot serve` and the ASR service
before anything starts threads or loads an OpenMP runtime (a first start's model pull
converts the LLM bundle with torch in-process): glibc malloc arenas (heap.py) and the
OpenMP threads and wait policy (threads.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from voicebot.runtime.heap import limit_arenas
from voicebot.runtime.threads import limit_omp_threads, set_omp_wait_policy

if TYPE_CHECKING:
    from voicebot.config import ServerConfig


def apply_process_settings(cfg: ServerConfig) -> None:
    limit_arenas(cfg.malloc_arena_max)
    limit_omp_threads(cfg.omp_threads)
    set_omp_wait_policy(cfg.omp_wait_policy)
