"""How late the event loop has run lately, from the loop watch's ticks.

:class:`~voicebot.runtime.loop_watch.LoopWatch` wakes every ``interval_s`` and records how
late it woke up. This keeps those samples for a while and answers two questions:

- **Is the loop overloaded now?** ``mean_lag(within_s)``: the mean lateness of the ticks
  in the last ``within_s`` seconds. The server refuses new calls over a limit of it
  (``server.admission_max_loop_lag_ms``). A mean over seconds, not the last sample nor
  the worst: one collector pause or one long callback is a single late tick that a mean
  over ~50 ticks barely moves, while a loop that is late most of the time (more work
  than its core can run) keeps the mean up for as long as it lasts, and lets it fall as
  soon as the loop keeps up again.
- **Was a timeout ours?** ``stalled(since)``: how many of the seconds since ``since``
  the loop spent late. A timeout measures wall time; when this process's loop was stuck
  for most of the wait, the peer's answer may have sat unread in the socket, and the
  failure says nothing about the peer (:meth:`LagHistory.was_late`).

Pure bookkeeping on the loop's thread: the clock is passed in, so tests drive it.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

# The share of a wait the loop must have spent late for a timeout over it to be ours: at
# least half, so the peer had less than half the time it was given.
LATE_SHARE = 0.5


class LoopLateness(Protocol):
    """What an engine's client asks of the loop watch when one of its timeouts fires."""

    def was_late_since(self, started: float) -> bool:
        """Whether this process's event loop ran late for at least half of the time since
        ``started`` (``time.monotonic()``): a timeout over that wait measured our loop,
        not the peer; its failure is not counted against the peer's health."""
        ...


class LagHistory:
    """The watch's samples (wake-up time, lateness) of the last ``span_s`` seconds.

    Bounded: at most one sample per tick, ticks at least ``interval_s`` apart."""

    def __init__(self, span_s: float, interval_s: float) -> None:
        self.span_s = span_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=int(span_s / interval_s) + 2)

    def observe(self, now: float, lag_s: float) -> None:
        self._samples.append((now, lag_s))
        while self._samples and self._samples[0][0] < now - self.span_s:
            self._samples.popleft()

    def mean_lag(self, within_s: float, now: float, pending_s: float = 0.0) -> float:
        """The mean lateness of the ticks of the last ``within_s`` seconds; ``pending_s``:
        the lateness of the tick that is due and has not run yet (the loop is stuck now),
        counted as one more sample."""
        total, n = 0.0, 0
        for t, lag in reversed(self._samples):
            if t < now - within_s:
                break
            total, n = total + lag, n + 1
        if pending_s > 0:
            total, n = total + pending_s, n + 1
        return total / n if n else 0.0

    def stalled(self, since: float, now: float, pending_s: float = 0.0) -> float:
        """Seconds of ``[since, now]`` the loop spent late: each tick's lateness (the time
        just before it woke), cut at ``since``, plus the lateness of the tick still due."""
        total = min(pending_s, max(0.0, now - since))
        for t, lag in reversed(self._samples):
            if t <= since:
                break
            total += min(lag, t - since)
        return total

    def was_late(self, since: float, now: float, pending_s: float = 0.0) -> bool:
        """Whether the loop was late for at least :data:`LATE_SHARE` of ``[since, now]``."""
        waited = now - since
        return waited > 0 and self.stalled(since, now, pending_s) >= LATE_SHARE * waited


def loop_was_late(loop: LoopLateness | None, started: float) -> bool:
    """Whether a timeout over the wait since ``started`` was this process's loop's (never
    without a watch: then every timeout counts against the peer, as before it)."""
    return loop is not None and loop.was_late_since(started)
