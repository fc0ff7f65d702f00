"""Watch the event loop every call shares: how late it runs, and what blocks it.

All sessions, every transport and the engines' asyncio sides run on one loop. Code that
blocks it (a synchronous call where an ``await`` or a thread was meant, a large message
handled in one go) stalls every call at once, and nothing else in the server says so.

Two parts:
- a task on the loop that sleeps ``interval_s`` and records how late it woke up
  (``voicebot_event_loop_lag_seconds``): the delay every ready callback sees;
- a daemon thread that checks the task's heartbeat. When the loop has not run for
  ``stall_s`` it logs, once per stall, the loop thread's stack *while it is blocked*:
  the line to fix. When the loop runs again the task logs how long it was stuck.

A blocking call that holds the GIL (C code that does not release it) stops the thread
too: then only the "was blocked" line comes, after the fact.

The ticks of the last minute are kept (:mod:`voicebot.runtime.loop_lag`): the server's
admission reads how late the loop has been lately (:meth:`LoopWatch.mean_lag`), and the
engines' clients ask whether a timeout that fired measured our loop rather than their
peer (:meth:`LoopWatch.was_late_since`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

from voicebot.runtime.loop_lag import LagHistory

log = logging.getLogger(__name__)

# How long the ticks are kept: longer than the timeouts whose waits were_late_since judges
# (a longer wait is judged on its last minute only).
HISTORY_S = 60.0

# Where asyncio calls a ready callback (Handle._run): every stack on the loop goes through it.
_HANDLE_RUN = os.path.join("asyncio", "events.py")


class LoopWatch:
    """``stall_s``: how long a stall must be for its stack to be logged (0: no stack logs,
    no thread; the lateness is still measured)."""

    def __init__(self, stall_s: float, *, interval_s: float = 0.1,
                 on_lag: Callable[[float], None] | None = None,
                 on_stall: Callable[[], None] | None = None,
                 on_late_timeout: Callable[[], None] | None = None) -> None:
        self.stall_s = stall_s
        self.interval_s = interval_s
        self._on_lag = on_lag
        self._on_stall = on_stall
        self._on_late_timeout = on_late_timeout
        self.history = LagHistory(HISTORY_S, interval_s)
        # The tick's last wake-up, and the one whose stall the thread reported (so a stall
        # is counted once, by whichever side sees it first). Both under _lock: the thread
        # checks and sets, the tick moves the beat on.
        self._lock = threading.Lock()
        self._beat = time.monotonic()
        self._reported_beat: float | None = None
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread = 0
        self.stalls = 0
        self.max_lag_s = 0.0
        self.late_timeouts = 0  # timeouts was_late_since excused

    def start(self) -> None:
        """Start watching the running loop (from a coroutine on it)."""
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="loop-watch")
        if self.stall_s > 0:
            self._thread = threading.Thread(target=self._watch, name="voicebot-loop-watch", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ lateness
    def pending_lag(self, now: float) -> float:
        """How late the tick that is due now is (0 before the watch starts): while the
        loop is stuck, the lateness no tick has recorded yet."""
        if self._task is None:
            return 0.0
        return max(0.0, now - self._beat - self.interval_s)

    def mean_lag(self, within_s: float) -> float:
        """The mean lateness of the loop's ticks over the last ``within_s`` seconds (the
        tick still due included): the admission's measure."""
        now = time.monotonic()
        return self.history.mean_lag(within_s, now, self.pending_lag(now))

    def was_late_since(self, started: float) -> bool:
        """Whether the loop ran late for at least half of the time since ``started``
        (``time.monotonic()``): a timeout over that wait measured our loop, not the peer
        (:class:`~voicebot.runtime.loop_lag.LoopLateness`). Each such answer is counted."""
        now = time.monotonic()
        late = self.history.was_late(started, now, self.pending_lag(now))
        if late:
            self.late_timeouts += 1
            if self._on_late_timeout is not None:
                self._on_late_timeout()
        return late

    async def aclose(self) -> None:
        """Stop watching (a watch never started closes too)."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            with self._lock:
                # Late by: the time past this wake-up's due time, the thread's measure too.
                lag = max(0.0, now - self._beat - self.interval_s)
                seen_by_thread = self._reported_beat == self._beat
                self._beat = now
            self.max_lag_s = max(self.max_lag_s, lag)
            self.history.observe(now, lag)
            if self._on_lag is not None:
                self._on_lag(lag)
            # A stall the thread reported is at least stall_s late here too (both measure
            # past the same due time), so this line follows every stack the thread logged.
            if self.stall_s > 0 and lag >= self.stall_s:
                if not seen_by_thread:
                    self._count_stall()  # the thread could not look (the GIL was held)
                log.warning("the event loop was blocked for %.2f s: every call stalled with it", lag)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                beat = self._beat
                stuck = time.monotonic() - beat - self.interval_s
                if stuck < self.stall_s or self._reported_beat == beat:
                    continue
                self._reported_beat = beat
            self._count_stall()
            frame = sys._current_frames().get(self._loop_thread)
            where = _blocked_at(frame) if frame is not None else "(no frame)\n"
            if self._beat != beat:
                continue  # the loop ran on meanwhile: that stack is not where it was stuck
            log.warning("the event loop has not run for %.2f s (server.loop_stall_s %g); it is blocked at:\n%s",
                        stuck, self.stall_s, where.rstrip())

    def _count_stall(self) -> None:
        self.stalls += 1
        if self._on_stall is not None:
            self._on_stall()


def _blocked_at(frame: FrameType) -> str:
    """The loop thread's stack from the callback the loop is running in: the frames
    outside it (the program's entry, ``run_forever``, ``_run_once``) are the same in every
    report, and a log viewer that keeps the first lines would cut the one to fix."""
    stack = traceback.extract_stack(frame)
    start = 0
    for i, f in enumerate(stack):
        if f.name == "_run" and f.filename.endswith(_HANDLE_RUN):
            start = i + 1  # the innermost: a loop run inside a callback is the one that is blocked
    return "".join(traceback.format_list(stack[start:]))


@contextlib.asynccontextmanager
async def watching_loop(stall_s: float, **kwargs: Any) -> AsyncIterator[LoopWatch | None]:
    """A :class:`LoopWatch` on the running loop while inside (none for ``stall_s`` 0)."""
    if stall_s <= 0:
        yield None
        return
    watch = LoopWatch(stall_s, **kwargs)
    watch.start()
    try:
        yield watch
    finally:
        await watch.aclose()
