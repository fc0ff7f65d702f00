"""The ASR engine's bounded two-class job queue (pure, synchronous, no I/O).

Finals (a finished turn waiting for its transcript) go before anyone's partials; within
a class jobs run first come, first served. Each stream keeps at most one partial queued
or running, so FIFO among partials is a round-robin over sessions and none starves.

When the queue is full a new partial is refused (the caller counts it and retries on its
next audio), and a final evicts the newest queued partial instead: a partial is a
preview that the next one supersedes, while a final is what the user waits for. Only a
queue full of finals makes a final wait.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from voicebot.engines.asr.stream import AsrStream


class Priority(IntEnum):
    FINAL = 0
    PARTIAL = 1


class Job(Protocol):
    @property
    def priority(self) -> Priority: ...

    @property
    def owner(self) -> object: ...


J = TypeVar("J", bound=Job)


@dataclass(eq=False)
class DecodeJob:
    """One decode. Compared by identity: the queue removes *this* job, not an equal one."""

    priority: Priority
    owner: AsrStream | None  # None: one-shot AsrEngine.transcribe()
    audio: np.ndarray | None = None  # finals: snapshot at the call; partials: at dispatch
    prefix: str = ""  # confirmed words forced as Whisper's prefix
    language: str | None = None
    generation: int = 0  # the owner's utterance this job belongs to
    seq: int = 0  # dispatch order, engine-wide
    future: asyncio.Future[tuple[str, float]] | None = None  # finals: (text, decode_s)
    # Nobody will use the result (a partial the final superseded, a final whose waiter
    # left): set on the event loop, read by the decode thread at its checkpoints.
    stale: bool = False

    def fail(self, exc: Exception) -> None:
        if self.future is not None:
            if not self.future.done():
                self.future.set_exception(exc)
        elif self.owner is not None:
            self.owner._partial_done(self, None)


class JobQueue(Generic[J]):
    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize
        self._finals: deque[J] = deque()
        self._partials: deque[J] = deque()

    def __len__(self) -> int:
        return len(self._finals) + len(self._partials)

    def offer_partial(self, job: J) -> bool:
        """Queue a partial if there is room; False means it was dropped."""
        if len(self) >= self.maxsize:
            return False
        self._partials.append(job)
        return True

    def can_take_final(self) -> bool:
        return len(self) < self.maxsize or bool(self._partials)

    def put_final(self, job: J) -> J | None:
        """Queue a final, evicting the newest partial if full; return the evicted job."""
        evicted = None
        if len(self) >= self.maxsize:
            if not self._partials:
                raise OverflowError("queue full of finals; wait for can_take_final()")
            evicted = self._partials.pop()
        self._finals.append(job)
        return evicted

    def pop(self) -> J | None:
        if self._finals:
            return self._finals.popleft()
        if self._partials:
            return self._partials.popleft()
        return None

    def remove(self, job: J) -> bool:
        queue = self._finals if job.priority is Priority.FINAL else self._partials
        try:
            queue.remove(job)
        except ValueError:
            return False
        return True

    def remove_owner(self, owner: object) -> list[J]:
        """Take out every job of ``owner`` (a closing stream), in queue order."""
        taken = [j for q in (self._finals, self._partials) for j in q if j.owner is owner]
        for job in taken:
            self.remove(job)
        return taken
