"""What every ASR stream shares with its reader: the partials it yields, and its close.

A stream is read with ``async for partial in stream`` and closed with ``async with``
(the :class:`~voicebot.engines.contracts.AsrStream` contract). :class:`PartialStream`
gives a backend's stream both; the backend fills :attr:`~PartialStream.partials`.
"""

from __future__ import annotations

import asyncio
from typing import Self

from voicebot.engines.contracts import Partial

_BUFFERED = 4  # per stream; a newer partial supersedes the oldest


class PartialQueue:
    """Partials waiting for their reader, latest-wins and bounded: a reader that falls
    behind misses stale previews, never the newest. ``None`` ends it for good."""

    def __init__(self, size: int = _BUFFERED) -> None:
        self._queue: asyncio.Queue[Partial | None] = asyncio.Queue(size)

    def put(self, item: Partial | None) -> None:
        if self._queue.full():
            self._queue.get_nowait()  # drop the oldest: the newer one supersedes it
        self._queue.put_nowait(item)

    def clear(self) -> None:
        """Drop what waits: previews of an utterance that was reset are stale."""
        while not self._queue.empty():
            self._queue.get_nowait()

    async def get(self) -> Partial:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # later calls end too
            raise StopAsyncIteration
        return item


class PartialStream:
    """Async iteration over :attr:`partials` and ``async with`` closing by :meth:`aclose`."""

    partials: PartialQueue

    async def aclose(self) -> None:
        raise NotImplementedError

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Partial:
        return await self.partials.get()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
