"""The event-loop watch (voicebot/runtime/loop_watch.py): a blocked loop is reported with
the stack it is blocked at, while it is blocked; a loop that runs is not."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from voicebot.runtime.loop_watch import LoopWatch, watching_loop

WATCH_LOG = "voicebot.runtime.loop_watch"


def block_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous call on the loop: what the watch is for


def watch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "voicebot-loop-watch"]


async def test_a_blocked_loop_is_reported_with_where_it_is_blocked(caplog: pytest.LogCaptureFixture) -> None:
    lags: list[float] = []
    stalls: list[int] = []
    watch = LoopWatch(0.5, interval_s=0.05, on_lag=lags.append, on_stall=lambda: stalls.append(1))
    caplog.set_level(logging.WARNING, logger=WATCH_LOG)
    watch.start()
    try:
        await asyncio.sleep(0.2)
        block_the_loop_for(1.5)  # a second of margin for the thread to look, on a loaded machine
        # The thread looked while the loop was blocked: the stack names the blocking call.
        during = [r.getMessage() for r in caplog.records if "has not run for" in r.getMessage()]
        assert len(during) == 1, caplog.text
        assert "block_the_loop_for" in during[0] and "time.sleep(seconds)" in during[0], during[0]
        # From the callback the loop runs: not the frames every report shares around it.
        assert "test_a_blocked_loop_is_reported" in during[0].split("blocked at:\n")[1].splitlines()[0], during[0]
        assert "base_events.py" not in during[0] and "_pytest" not in during[0], during[0]
        await asyncio.sleep(0.2)  # the loop runs again: the tick says how long it was stuck
        after = [r.getMessage() for r in caplog.records if "was blocked for" in r.getMessage()]
        assert len(after) == 1 and float(after[0].split("for ")[1].split(" s")[0]) >= 1.4, after
        assert stalls == [1] and watch.stalls == 1  # one stall, counted once
        assert max(lags) >= 1.4 and watch.max_lag_s == max(lags)
    finally:
        await watch.aclose()
    assert watch_threads() == []


async def test_a_loop_that_runs_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    lags: list[float] = []
    watch = LoopWatch(2.0, interval_s=0.05, on_lag=lags.append)  # 2 s: never a loaded machine's lag
    caplog.set_level(logging.WARNING, logger=WATCH_LOG)
    watch.start()
    try:
        for _ in range(10):
            block_the_loop_for(0.02)  # short synchronous work between awaits is normal
            await asyncio.sleep(0.03)
    finally:
        await watch.aclose()
    assert watch.stalls == 0 and not caplog.records, caplog.text
    assert len(lags) >= 4 and all(0.0 <= lag < 2.0 for lag in lags), lags
    assert watch_threads() == []


async def test_a_stall_with_the_gil_held_is_still_counted_after_the_fact(caplog: pytest.LogCaptureFixture) -> None:
    # C code that keeps the GIL stops the watching thread too; it cannot look, so the tick
    # counts the stall once the loop runs again. Simulated by stopping the thread first.
    watch = LoopWatch(0.5, interval_s=0.05)
    caplog.set_level(logging.WARNING, logger=WATCH_LOG)
    watch.start()
    try:
        await asyncio.sleep(0.1)
        watch._stop.set()
        assert watch._thread is not None
        await asyncio.to_thread(watch._thread.join)
        block_the_loop_for(1.0)
        await asyncio.sleep(0.15)
    finally:
        await watch.aclose()
    assert watch.stalls == 1, caplog.text
    assert any("was blocked for" in r.getMessage() for r in caplog.records)
    assert not any("has not run for" in r.getMessage() for r in caplog.records)


async def test_watching_loop_is_a_watch_while_inside(caplog: pytest.LogCaptureFixture) -> None:
    # What voicebot asr-serve / tts-serve wrap their serving and closing in: one loop there
    # serves every frontend's requests.
    caplog.set_level(logging.WARNING, logger=WATCH_LOG)
    async with watching_loop(0.0) as none:
        assert none is None and watch_threads() == []  # server.loop_stall_s 0: no watch
    async with watching_loop(0.5, interval_s=0.05) as watch:
        assert watch is not None and watch_threads() == ["voicebot-loop-watch"]
        await asyncio.sleep(0.1)
        block_the_loop_for(1.5)
        await asyncio.sleep(0.2)
    assert watch.stalls == 1 and watch_threads() == []
    assert any("block_the_loop_for" in r.getMessage() for r in caplog.records), caplog.text
