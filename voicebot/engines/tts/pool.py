"""The worker pool that the local TTS engines (Piper, espeak-ng) use to keep synthesis off
the event loop; the contract they implement is :class:`voicebot.engines.contracts.Tts`.

Streaming model: text is cleaned (markdown, emoji ... removed, :mod:`.text`), cut into
sentences, and each sentence becomes one *job* in the engine's :class:`WorkerPool`. A stream
keeps at most one job in the pool at a time (the next sentence is submitted when the
previous one's audio is handed over), so sessions interleave sentence by sentence
and a stream's memory never grows beyond one sentence of look-ahead.

Consumers should iterate inside ``contextlib.aclosing(engine.synthesize(...))`` (or
in a task they cancel): then stopping early drops the stream's queued job at once.
A bare ``break`` also works but waits for the generator to be garbage-collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from voicebot.errors import CapacityError, EngineError

log = logging.getLogger(__name__)

T = TypeVar("T")


# --- worker pool -------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    """Handle of one submitted job: await ``future``; cancel with ``WorkerPool.cancel``."""

    fn: Callable[[], Any]
    abort: Callable[[], None] | None
    future: asyncio.Future[Any]
    cancelled: bool = False


class WorkerPool:
    """``workers`` threads shared by every session, plus a FIFO of at most ``queue_size`` waiting jobs.

    A full FIFO raises :class:`CapacityError` instead of applying backpressure: each
    stream holds at most one job here, so the FIFO only fills when more streams are
    synthesising than ``queue_size`` allows, and a sentence that waits behind that
    many others would arrive too late to be worth speaking anyway.

    Cancelling a job drops it if it is still waiting; if it is running, its ``abort``
    hook (if any) is called and its result discarded. The slot is freed only when the
    thread really finishes, so the pool never runs more than ``workers`` jobs at once,
    whatever the consumers do.
    """

    def __init__(self, workers: int, queue_size: int, name: str) -> None:
        self.workers = workers
        self.queue_size = queue_size
        self.name = name
        self._waiting: deque[Job] = deque()
        self._running: set[Job] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Counters for metrics and tests.
        self.completed = 0
        self.dropped = 0  # cancelled while waiting: never ran
        self.discarded = 0  # cancelled while running: result thrown away
        # Jobs that raised since the last one that succeeded: the engine's health
        # (one failing sentence is that sentence's problem, every one failing is ours).
        self.failure_streak = 0
        self.last_error: BaseException | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)

    @property
    def depth(self) -> int:
        # Cancelled jobs leave the deque at once (see cancel), so this is exact.
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, fn: Callable[[], T], abort: Callable[[], None] | None = None) -> Job:
        if self._executor is None or self._loop is None:
            raise EngineError(f"{self.name}: engine is not started (or already closed)")
        if len(self._running) >= self.workers and len(self._waiting) >= self.queue_size:
            raise CapacityError(
                f"{self.name}: {len(self._waiting)} sentences already waiting (tts.queue_size)"
            )
        job = Job(fn, abort, self._loop.create_future())
        # A task cancelled while awaiting the future cancels it: treat that like cancel().
        job.future.add_done_callback(lambda fut: self.cancel(job) if fut.cancelled() else None)
        if len(self._running) < self.workers:
            self._launch(job)
        else:
            self._waiting.append(job)
        return job

    def cancel(self, job: Job, error: Exception | None = None) -> None:
        """Drop or abort ``job`` now (synchronously: the queue depth drops before this returns).

        With ``error`` the job's awaiter gets that error instead of a CancelledError
        (used by aclose: the consumer's task was not cancelled, so it must not see one).
        """
        if not job.future.done():
            if error is None:
                job.future.cancel()
            else:
                job.future.set_exception(error)
        if not job.future.cancelled():
            job.future.exception()  # mark retrieved: its consumer may be gone (no log noise)
        if job.cancelled or (job not in self._running and job not in self._waiting):
            return  # already handled, or finished and delivered
        job.cancelled = True
        if job in self._running:
            self.discarded += 1
            if job.abort is not None:
                job.abort()
        else:
            self._waiting.remove(job)
            self.dropped += 1

    def _launch(self, job: Job) -> None:
        assert self._executor is not None and self._loop is not None
        self._running.add(job)
        loop = self._loop

        def done(tf: ThreadFuture[Any]) -> None:  # in the worker thread
            # RuntimeError: the loop is closed (engine never aclose()d): nobody to tell.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._finished, job, tf)

        self._executor.submit(job.fn).add_done_callback(done)

    def _finished(self, job: Job, tf: ThreadFuture[Any]) -> None:
        self._running.discard(job)
        if not job.cancelled:  # an aborted job's outcome says nothing about the engine
            failure = tf.exception()
            self.failure_streak = self.failure_streak + 1 if failure is not None else 0
            self.last_error = failure or self.last_error
        if not job.future.done():
            exc = tf.exception()
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(tf.result())
            self.completed += 1
        while self._waiting and len(self._running) < self.workers and self._executor is not None:
            self._launch(self._waiting.popleft())

    async def aclose(self) -> None:
        executor, self._executor = self._executor, None
        closed = EngineError(f"{self.name}: engine closed")
        for job in [*self._waiting, *self._running]:
            self.cancel(job, closed)
        if executor is not None:
            # Wait for the running pieces so no thread outlives the engine.
            await asyncio.to_thread(executor.shutdown, wait=True)
        # Let the threads' call_soon_threadsafe callbacks run before the loop may close.
        await asyncio.sleep(0)


async def stream_jobs(
    pool: WorkerPool, jobs: Iterable[tuple[Callable[[], np.ndarray], Callable[[], None] | None]]
) -> AsyncGenerator[np.ndarray, None]:
    """Run ``jobs`` (sentence synthesisers) one after another, yielding non-empty results.

    The next job is submitted before the current result is yielded, so it is synthesised
    while the consumer plays the current one. On cancellation or early close the
    outstanding job is cancelled (dropped if queued, aborted/discarded if running) and
    the CancelledError / GeneratorExit goes on up.
    """
    it = iter(jobs)
    first = next(it, None)
    pending = pool.submit(*first) if first is not None else None
    try:
        while pending is not None:
            audio = await pending.future
            nxt = next(it, None)
            pending = pool.submit(*nxt) if nxt is not None else None
            if audio.size:
                yield audio
    finally:
        if pending is not None:
            pool.cancel(pending)


class PooledTts:
    """The views of its :class:`WorkerPool` that a pooled engine (Piper, espeak-ng) gives the
    server: a mixin with no behaviour of its own."""

    _pool: WorkerPool

    async def aclose(self) -> None:
        await self._pool.aclose()

    @property
    def queue_depth(self) -> int:
        return self._pool.depth

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    @property
    def failure_streak(self) -> int:
        """Syntheses failed in a row (the supervisor's health probe)."""
        return self._pool.failure_streak

    @property
    def last_error(self) -> BaseException | None:
        return self._pool.last_error
