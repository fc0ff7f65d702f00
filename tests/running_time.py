"""Waits whose time limit counts the time this test process ran, not the time it stood still.

On a loaded 2-core CI machine a whole test process can go unscheduled for 10-60 s (seen
while another worker started two vLLM servers beside it): its event loop, the in-process
server on it and the test's own waits all stand still. A wall-clock limit then fails a
call that the server handled in its usual time. These waits measure how late the loop's
own 50 ms ticks come; time the loop did not run at all is not counted against the limit
(a stall the server's own loop watch logs and counts). Everything that ran is counted as
before, so a slow server still fails the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable

TICK_S = 0.05
STALL_S = 0.5  # a tick this late means the loop did not run: not counted
HARD_LIMIT = 4.0  # and never waits more than this many times the limit, stalls or not


class RunningClock:
    """Seconds since start, less the stalls the ticker saw."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.stalled = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start - self.stalled

    def wall(self) -> float:
        return time.monotonic() - self.start

    def over(self, timeout_s: float) -> bool:
        """``timeout_s`` of running time have passed (or the hard limit of wall time)."""
        return self.elapsed() > timeout_s or self.wall() > HARD_LIMIT * timeout_s

    def waited(self) -> str:
        stalled = f", of which {self.stalled:.1f} s stalled" if self.stalled else ""
        return f"{self.wall():.1f} s{stalled}"

    async def tick(self) -> None:
        while True:
            due = time.monotonic() + TICK_S
            await asyncio.sleep(TICK_S)
            late = time.monotonic() - due
            if late > STALL_S:
                self.stalled += late


@contextlib.asynccontextmanager
async def running_clock() -> AsyncIterator[RunningClock]:
    clock = RunningClock()
    ticker = asyncio.create_task(clock.tick())
    try:
        yield clock
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker


async def until(cond: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll ``cond`` (a function, or a coroutine function) until it returns something true
    and return that; fail after ``timeout_s`` of running time."""
    async with running_clock() as clock:
        while True:
            got = cond()
            if inspect.isawaitable(got):
                got = await got
            if got:
                return got
            if clock.over(timeout_s):
                raise AssertionError(f"timed out waiting for {what} ({clock.waited()})")
            await asyncio.sleep(0.02)
