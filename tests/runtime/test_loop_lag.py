"""How late the loop has run lately (voicebot/runtime/loop_lag.py): the admission's mean
over a window, and whether a timeout's wait was spent with our own loop stalled. The
samples and the clock are given, as the loop watch gives them: no real time is measured."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from voicebot.runtime.loop_lag import LagHistory, loop_was_late
from voicebot.runtime.loop_watch import LoopWatch

TICK = 0.1


def healthy_then_stalled(h: LagHistory, start: float, healthy_s: float, stalls: list[float]) -> float:
    """Ticks every 100 ms, a few ms late, for ``healthy_s``; then ticks each ``stalls[i]``
    late (the loop stuck that long before each). Returns the time of the last tick."""
    t = start
    for _ in range(round(healthy_s / TICK)):
        t += TICK + 0.002
        h.observe(t, 0.002)
    for lag in stalls:
        t += TICK + lag
        h.observe(t, lag)
    return t


def test_the_mean_over_the_window_ignores_one_stall_and_follows_a_loop_late_all_the_time() -> None:
    h = LagHistory(60.0, TICK)
    t = healthy_then_stalled(h, 0.0, 10.0, [])
    assert h.mean_lag(5.0, t) == pytest.approx(0.002)
    # One pause of 1.5 s among healthy ticks: the mean over 5 s stays far under 500 ms.
    t = healthy_then_stalled(h, t, 0.0, [1.5])
    t = healthy_then_stalled(h, t, 2.0, [])
    assert h.mean_lag(5.0, t) < 0.1
    # A loop late by ~2 s at every tick (more work than its core runs): the mean is that.
    t = healthy_then_stalled(h, t, 0.0, [2.0, 1.8, 2.2, 2.0])
    assert h.mean_lag(5.0, t) > 1.0
    # Caught up: once the late ticks are older than the window, the mean is healthy again.
    t = healthy_then_stalled(h, t, 5.5, [])
    assert h.mean_lag(5.0, t) == pytest.approx(0.002)


def test_a_tick_still_due_counts_as_one_more_sample() -> None:
    h = LagHistory(60.0, TICK)
    t = healthy_then_stalled(h, 0.0, 1.0, [])
    assert h.mean_lag(5.0, t + 3.0, pending_s=3.0) > 0.2  # the loop is stuck right now
    assert LagHistory(60.0, TICK).mean_lag(5.0, 10.0) == 0.0  # no sample: not late


def test_stalled_time_is_cut_at_the_start_of_the_wait() -> None:
    h = LagHistory(60.0, TICK)
    h.observe(10.0, 2.0)  # the loop was stuck from 8 to 10
    h.observe(10.1, 0.0)
    assert h.stalled(9.0, 10.1) == pytest.approx(1.0)  # only 9 to 10 is within the wait
    assert h.stalled(10.0, 10.1) == 0.0
    assert h.stalled(10.0, 12.1, pending_s=1.9) == pytest.approx(1.9)  # stuck since 10.2


def test_a_wait_spent_mostly_with_the_loop_stalled_was_ours() -> None:
    h = LagHistory(60.0, TICK)
    # A wait begun at ``start`` whose next two ticks came ~1.9 s late each: 3.8 s of 4 stalled.
    t = healthy_then_stalled(h, 98.0, 2.0, [])
    start = t
    t = healthy_then_stalled(h, t, 0.0, [1.9, 1.9])
    assert h.was_late(start, t)
    # The same wait with a healthy loop: the timeout is the peer's.
    h2 = LagHistory(60.0, TICK)
    t2 = healthy_then_stalled(h2, 98.0, 2.0, [])
    start2 = t2
    t2 = healthy_then_stalled(h2, t2, 2.0, [])
    assert not h2.was_late(start2, t2)
    # A short stall in a long wait: the peer had most of its time.
    t2 = healthy_then_stalled(h2, t2, 0.0, [1.0])
    t2 = healthy_then_stalled(h2, t2, 8.0, [])
    assert not h2.was_late(start2, t2)


def test_the_history_is_bounded() -> None:
    h = LagHistory(60.0, TICK)
    healthy_then_stalled(h, 0.0, 600.0, [])
    assert len(h._samples) <= 60.0 / TICK + 2


class _Late:
    def __init__(self, late: bool) -> None:
        self.late = late
        self.asked: list[float] = []

    def was_late_since(self, started: float) -> bool:
        self.asked.append(started)
        return self.late


def test_without_a_watch_no_timeout_is_excused() -> None:
    assert not loop_was_late(None, 0.0)
    watch = _Late(True)
    assert loop_was_late(watch, 5.0) and watch.asked == [5.0]


def test_the_watch_reads_its_ticks_and_counts_each_excused_timeout() -> None:
    excused: list[int] = []
    watch = LoopWatch(0.0, on_late_timeout=lambda: excused.append(1))
    assert watch.mean_lag(5.0) == 0.0 and watch.pending_lag(time.monotonic() + 100) == 0.0  # not started
    now = time.monotonic()
    started = now - 2.0
    watch.history.observe(now - 1.0, 0.9)
    watch.history.observe(now, 0.9)
    assert watch.mean_lag(5.0) == pytest.approx(0.9)
    assert watch.was_late_since(started) and watch.late_timeouts == 1 and excused == [1]
    assert not watch.was_late_since(now - 10.0)  # 1.8 s late of 10: the peer's timeout
    assert watch.late_timeouts == 1 and excused == [1]


async def test_a_watch_with_no_stall_limit_measures_lateness_without_its_thread() -> None:
    watch = LoopWatch(0.0, interval_s=0.01)
    watch.start()
    try:
        assert not [t for t in threading.enumerate() if t.name == "voicebot-loop-watch"]
        # The tick records samples (however late this machine runs it).
        deadline = time.monotonic() + 30.0
        while not watch.history._samples and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert watch.history._samples
    finally:
        await watch.aclose()
