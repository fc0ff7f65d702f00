"""Decode jobs, the ASR engine's bounded two-class queue of them, and the two seams around a
job: its owner (the stream it belongs to) and the decoder that runs it.

The queue is pure and synchronous (no I/O).

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
import contextlib
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Generic, Protocol, TypeVar

import numpy as np


class Priority(IntEnum):
    FINAL = 0
    PARTIAL = 1


class Job(Protocol):
    @property
    def priority(self) -> Priority: ...

    @property
    def owner(self) -> object: ...


J = TypeVar("J", bound=Job)
_T = TypeVar("_T")


class JobOwner(Protocol):
    """The stream a job belongs to: the engine fills a job in from it at dispatch (on the
    event loop, at the last moment) and hands it every partial's outcome."""

    def prepare_partial(self, job: DecodeJob) -> None:
        """Give a dispatched partial its audio and prefix (or leave its audio None: stale)."""
        ...

    def final_prefix(self, job: DecodeJob) -> str:
        """The forced prefix of a final about to be decoded."""
        ...

    def partial_done(self, job: DecodeJob, text: str | None) -> None:
        """A partial finished (``text``), or ended without a result (None)."""
        ...

    def partial_dropped(self, job: DecodeJob) -> None:
        """A partial was dropped for want of room: it is asked for again."""
        ...


@dataclass(eq=False)
class DecodeJob:
    """One decode. Compared by identity: the queue removes *this* job, not an equal one."""

    priority: Priority
    owner: JobOwner | None  # None: one-shot AsrEngine.transcribe(), or a job of the ASR service
    audio: np.ndarray | None = None  # finals: snapshot at the call; partials: at dispatch
    prefix: str = ""  # confirmed words forced as Whisper's prefix
    language: str | None = None
    # Sampling temperature: 0 (greedy) but for a fallback re-decode of a loop (loop_guard.py).
    temperature: float = 0.0
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
            self.owner.partial_done(self, None)


class DecodeAbandoned(Exception):
    """A decode stopped because nobody waits for its result any more: nothing to report."""


class DecodeDropped(Exception):
    """A partial found no room where it was to be decoded (the ASR service's queue): it is
    retried on its stream's next audio."""


class DecodeFailed(Exception):
    """A partial's decode failed and the decoder has reported it already (one log line for
    many): the engine only counts it."""


class Decoder(Protocol):
    """How an :class:`~voicebot.engines.asr.engine.AsrEngine` decodes one job: faster-whisper
    on threads (:mod:`.local`), Whisper on vLLM (:mod:`.vllm_whisper`) or the shared ASR
    service (:mod:`.remote`). The engine owns the queue, the streams and the bookkeeping;
    the decoder only turns a job's audio and forced prefix into text."""

    name: str
    """Prefix of the engine's decode-slot task names."""

    samples: bool
    """Whether a decode honours ``job.temperature`` (a fallback re-decode can differ)."""

    @property
    def slots(self) -> int:
        """Decodes that may run at once: the engine starts this many decode slots."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None:
        """Called after the engine's slots stopped: release the model, threads, connection."""
        ...

    async def decode(self, job: DecodeJob) -> tuple[str, float]:
        """The text after ``job.prefix`` and the decode time (seconds). May raise
        :class:`DecodeAbandoned` (stopped by :meth:`abandon`, or the final's waiter left),
        :class:`DecodeDropped` or :class:`DecodeFailed` for a partial; cancellation
        stops the upstream work (a vLLM request, the service's job) and propagates."""
        ...

    def abandon(self, job: DecodeJob) -> None:
        """Stop a running job whose result nobody will use (``job.stale`` is set already)
        at the decode's earliest safe point. It may still finish: then its result counts."""
        ...


async def unless_abandoned(decode: asyncio.Future[_T], waiter: asyncio.Future[Any]) -> _T:
    """A decode raced against ``waiter``: the result, or -- when the waiter goes first (a
    final's turn was cancelled, a partial superseded) -- the decode cancelled, so the
    upstream work stops (a vLLM request, the ASR service's job), and
    :class:`DecodeAbandoned`. Our own cancellation cancels the decode as well and propagates."""
    try:
        await asyncio.wait({decode, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        decode.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await decode
        raise
    if not decode.done():
        decode.cancel()
        try:
            with contextlib.suppress(Exception):
                await decode  # its cleanup: a vLLM abort, a cancel sent to the ASR service
        except asyncio.CancelledError:
            # The decode ended cancelled, as asked -- or we were cancelled while it stopped
            # (the engine closing): that must propagate, or the decode slot's task goes on
            # and AsrEngine.aclose() waits for it forever.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
        raise DecodeAbandoned
    return decode.result()


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
