"""The event-loop watch (voicebot/server/loop_watch.py): a blocked loop is reported with
the stack it is blocked at, while it is blocked; a loop that runs is not."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from voicebot.server.loop_watch import LoopWatch

WATCH_LOG = "voicebot.server.loop_watch"


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


async def test_the_services_loop_is_watched_while_it_listens(caplog: pytest.LogCaptureFixture) -> None:
    # voicebot asr-serve / tts-serve: one loop serves every frontend's requests.
    from websockets.asyncio.server import serve

    from voicebot.engines.service_wire import serve_until_stopped

    async def handler(ws: object) -> None:
        return None

    stop = asyncio.Event()
    urls: list[str] = []
    caplog.set_level(logging.WARNING, logger=WATCH_LOG)
    task = asyncio.create_task(serve_until_stopped(serve(handler, "127.0.0.1", 0), stop, urls.append, 0.5))
    while not urls:
        await asyncio.sleep(0.01)
    assert watch_threads() == ["voicebot-loop-watch"]
    block_the_loop_for(1.5)
    await asyncio.sleep(0.2)
    stop.set()
    await task
    assert any("block_the_loop_for" in r.getMessage() for r in caplog.records), caplog.text
    assert watch_threads() == []
