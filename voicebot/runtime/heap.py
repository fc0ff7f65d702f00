"""Keep the server's native heap from creeping up call after call (glibc only).

The soak (docs/reliability.md) showed the server's RSS floor rising a few MB per
session-hour while the Python heap kept almost nothing: the growth is native. Each
call allocates and frees many short-lived buffers (audio frames, feature arrays, JSON,
numpy temporaries) on the event loop and on worker threads (ASR, TTS, tokenizer), and
glibc gives every thread that contends for the heap an arena of its own (up to 8 per
core), each keeping its freed pages. Two standard remedies, both glibc's own:

- ``mallopt(M_ARENA_MAX, n)`` at start-up, before the worker threads exist: fewer
  arenas, so freed memory is reused instead of stranded in an idle thread's arena
  (the same as ``MALLOC_ARENA_MAX``, which must otherwise be in the environment
  before the process starts);
- ``malloc_trim(0)`` after a call ends: hand the arenas' free pages back to the OS.
  It walks the heap under the arena locks, so it runs on a thread and at most once per
  ``server.heap_trim_interval_s``, never per call under load.

On a C library without these (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc malloc.h


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")):
        return None  # not glibc
    return libc


_LIBC = _libc()


def limit_arenas(n: int) -> bool:
    """Cap glibc's malloc arenas at ``n`` (0: leave the default). True if applied."""
    if n <= 0 or _LIBC is None:
        return False
    ok = bool(_LIBC.mallopt(M_ARENA_MAX, n))
    if not ok:
        log.warning("mallopt(M_ARENA_MAX, %d) failed; the default arena count stays", n)
    return ok


def trim() -> bool:
    """``malloc_trim(0)``: True if memory was returned to the OS (False without glibc)."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))


class HeapTrimmer:
    """Trim the heap after calls end, at most once per ``interval_s``, off the event loop.

    ``session_ended`` is called from the loop when a call ends; a trim that would come
    too soon after the last one is deferred to the end of the interval (one pending at
    most), so the memory of a burst of hang-ups is still given back."""

    def __init__(self, interval_s: float, *, clock: Callable[[], float] = time.monotonic,
                 trim_fn: Callable[[], bool] = trim, on_trim: Callable[[], None] | None = None) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._trim = trim_fn
        self._on_trim = on_trim
        self._last = -float("inf")
        self._task: asyncio.Task[None] | None = None
        self.trims = 0

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 and (_LIBC is not None or self._trim is not trim)

    def session_ended(self) -> None:
        if not self.enabled or (self._task is not None and not self._task.done()):
            return  # off, or a trim is already due
        delay = max(0.0, self._last + self.interval_s - self._clock())
        self._task = asyncio.get_running_loop().create_task(self._run(delay), name="heap-trim")

    async def _run(self, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        self._last = self._clock()
        await asyncio.to_thread(self._trim)
        self.trims += 1
        if self._on_trim is not None:
            self._on_trim()

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # not `await task`: our own cancellation still propagates
