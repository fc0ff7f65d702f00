"""A session's bounded queue of outgoing events, from which queued items can be dropped.

Like ``asyncio.Queue`` (put_nowait raises ``QueueFull``, ``get`` waits), plus
:meth:`discard`: on barge-in the reply audio still waiting to be sent is taken out, so
the caller does not hear it and the barge-in event is not stuck behind it. Control
events stay, in their order.

The last ``reserve`` places are for control events only. A reply's audio and text wait
for room (:meth:`wait_for_room`) below that mark, so a client that reads slowly for a
moment (a network stall while a reply streams) fills the queue with reply data up to
the mark and no further: a transcript, a barge-in or an error emitted meanwhile still
fits, where it used to find the queue full and close the call as a stalled client. A
client that stopped reading fills the reserve too, and is closed then.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Outbox(Generic[T]):
    def __init__(self, maxsize: int, reserve: int | None = None) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize
        # An eighth for control events by default: 32 of the default 256.
        self.reserve = max(1, maxsize // 8) if reserve is None else reserve
        if not 0 <= self.reserve < maxsize:
            raise ValueError("reserve must be >= 0 and < maxsize")
        self._items: deque[T] = deque()
        self._data = asyncio.Event()  # not empty
        self._room = asyncio.Event()  # not full
        self._room.set()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return len(self._items) >= self.maxsize

    def data_room(self) -> bool:
        """Room for reply data: below the places reserved for control events."""
        return len(self._items) < self.maxsize - self.reserve

    def put_nowait(self, item: T) -> None:
        if self.full():
            raise asyncio.QueueFull
        self._items.append(item)
        self._data.set()
        if not self.data_room():
            self._room.clear()

    async def wait_for_room(self) -> None:
        """Return once there is room for reply data (the caller re-checks its own
        state, then puts)."""
        while not self.data_room():
            self._room.clear()
            await self._room.wait()

    async def get(self) -> T:
        # Several getters may wake at once; each re-checks. The item is taken in the
        # same step as the check, so a getter cancelled while waiting loses nothing.
        while not self._items:
            self._data.clear()
            await self._data.wait()
        return self.get_nowait()

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        if not self._items:
            self._data.clear()
        self._room.set()
        return item

    def discard(self, drop: Callable[[T], bool]) -> list[T]:
        """Take out every queued item for which ``drop`` is true; return them, in order."""
        dropped = [item for item in self._items if drop(item)]
        if dropped:
            kept = [item for item in self._items if not drop(item)]
            self._items.clear()
            self._items.extend(kept)
            if not self._items:
                self._data.clear()
            self._room.set()
        return dropped
