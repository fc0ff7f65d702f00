"""The session core's notion of time, injectable so timing tests need no wall clock.

Every timing decision of a session (pacing, the idle timeout, the longest turn,
per-turn latencies) goes through a :class:`Clock`. Production uses :class:`RealClock`;
tests use :class:`VirtualClock` and move time on explicitly, so a loaded machine
cannot make them flaky: virtual time passes only when the test says so.

The silence rule of turn detection needs neither: it counts time in audio windows.
Smart Turn's cap on an "unfinished" verdict is wall-clock time since the last window
(a client may stop sending after its question), so it runs on this clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """The event loop's own time."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


REAL_CLOCK = RealClock()


class VirtualClock:
    """Time that moves only in :meth:`advance`; sleepers wake in deadline order.

    After each step the event loop is given ``settle_rounds`` turns, so the work a
    wake-up triggers (which may start more sleeps) runs before time moves on. Work
    in other threads is not waited for: keep it out of virtually timed tests.
    """

    def __init__(self, start: float = 1000.0, settle_rounds: int = 40) -> None:
        self._now = start
        self._settle_rounds = settle_rounds
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut  # a cancelled sleeper's future is skipped when its deadline comes

    async def settle(self) -> None:
        """Let every task that can run, run (without moving time)."""
        for _ in range(self._settle_rounds):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move time ``seconds`` on, waking each sleeper at its own deadline."""
        target = self._now + seconds
        await self.settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline = self._sleepers[0][0]
            self._now = max(self._now, deadline)
            while self._sleepers and self._sleepers[0][0] <= self._now:
                _, _, fut = heapq.heappop(self._sleepers)
                if not fut.done():
                    fut.set_result(None)
            await self.settle()
        self._now = max(self._now, target)
        await self.settle()
