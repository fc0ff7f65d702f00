"""voicebot/runtime/heap.py: calls ending give the heap's free pages back, at a bounded rate."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from voicebot.runtime import heap
from voicebot.runtime.heap import HeapTrimmer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


_sleep = asyncio.sleep  # the real one: a test below patches asyncio.sleep


async def settle(done: Callable[[], bool] | None = None, timeout: float = 10.0) -> None:
    """Until ``done()`` (the trim runs on to_thread's worker, on a loaded machine whenever
    that gets a core), then 50 ms more for anything that must not follow; without ``done``
    just those 50 ms."""
    for _ in range(20):
        await _sleep(0)
    deadline = asyncio.get_running_loop().time() + timeout
    while done is not None and not done() and asyncio.get_running_loop().time() < deadline:
        await _sleep(0.01)
    await _sleep(0.05)


async def test_a_call_ending_trims_and_a_burst_trims_once_more_after_the_interval(monkeypatch) -> None:
    clock = Clock()
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(delay: float) -> None:
        sleeps.append(delay)
        clock.now += delay
        await real_sleep(0)

    calls: list[float] = []
    trimmer = HeapTrimmer(30.0, clock=clock, trim_fn=lambda: calls.append(clock.now) or True)
    trimmer.session_ended()
    await settle(lambda: trimmer.trims >= 1)  # the task done, not only its thread's call
    assert calls == [100.0], "the first call's end trims at once"

    clock.now += 5
    monkeypatch.setattr(heap.asyncio, "sleep", fake_sleep)
    for _ in range(5):  # a burst of hang-ups 5 s later: one trim, when the interval is over
        trimmer.session_ended()
    await settle(lambda: trimmer.trims >= 2)
    assert sleeps == [25.0], sleeps
    assert calls == [100.0, 130.0], calls
    assert trimmer.trims == 2
    await trimmer.aclose()


async def test_off_means_never_and_closing_cancels_a_pending_trim() -> None:
    calls: list[int] = []
    off = HeapTrimmer(0.0, trim_fn=lambda: calls.append(1) or True)
    off.session_ended()
    await settle()
    assert calls == [] and off.trims == 0

    clock = Clock()
    trimmer = HeapTrimmer(30.0, clock=clock, trim_fn=lambda: calls.append(2) or True)
    trimmer.session_ended()
    await settle(lambda: trimmer.trims >= 1)
    trimmer.session_ended()  # due in 30 s
    await trimmer.aclose()
    await settle()
    assert calls == [2], "the pending trim was cancelled at shutdown"


def test_glibc_calls_work_here() -> None:
    # CI and this machine run glibc: both calls must really reach it (not the no-op path).
    assert heap._LIBC is not None, "glibc's malloc_trim/mallopt not found"
    assert heap.limit_arenas(0) is False  # 0: leave the default
    assert heap.limit_arenas(8) is True
    assert isinstance(heap.trim(), bool)
