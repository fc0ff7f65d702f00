"""One Kokoro model shared by every session: clauses from many sessions meet in one
bounded queue and are synthesised in batches (``voicebot/engines/tts/kokoro_model.py``).

- :class:`ClauseQueue` (plain, synchronous): at most ``size`` waiting clauses, handed out
  earliest deadline first. A session's first clause is due at once; a later clause is due
  when playback reaches it, so it may wait behind other sessions' first clauses.
- :class:`KokoroBatcher` (asyncio): one task takes up to ``max_batch`` clauses and
  ``max_frames`` frames of speech (estimated: :attr:`Clause.frames`) whenever a forward
  slot (``workers`` threads, each with its own CUDA stream) is free, runs :func:`encode` on
  all of them, then :func:`decode` on groups of similar length, and hands each clause's
  audio over as soon as its group is done.

A forward cannot be interrupted, and every forward's decodes share one GPU stream: a clause
that falls due while one runs waits for it. The frames bound keeps that wait short: when 256
replies began at once, forwards of up to 64 clauses took 414 ms at p95, bounded to 32 s of
speech 170 ms (docs/gpu-results.md). Speech a second hardly depends on the size past ~30 s
a forward: 933 s a second at 28 s, 1,027 at 245 (H200, compiled with CUDA graphs).

Cancelling the awaiting task drops a waiting clause at once; a running clause is skipped
if its group has not started yet, else its audio is discarded. A full queue raises
:class:`CapacityError` (as ``WorkerPool`` does: a clause behind that many would be late
anyway). A failing forward fails every clause of its batch with :class:`EngineError`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from voicebot.errors import CapacityError, EngineError
from voicebot.runtime.recent import RecentTimes, RecentWork

log = logging.getLogger(__name__)

FRAMES_PER_PHONEME = 2.53  # Kokoro-82M's predicted durations, on average, at speed 1
FRAMES_PER_S = 40  # the decoder's frame rate (24 kHz / 600 samples)


@dataclass(eq=False)
class Clause:
    """One clause to synthesise; ``future`` gets its float32 audio."""

    ids: Sequence[int]
    style: Any  # [256] tensor: the voice's style for this clause's length
    speed: float
    deadline: float
    future: asyncio.Future[np.ndarray]
    durations: Sequence[int] | None = None  # forced frames per phoneme (random-weight benchmarks)
    seq: int = 0
    queued: bool = False
    queued_at: float = 0.0  # perf_counter when pushed

    @property
    def frames(self) -> int:
        """Its speech in decoder frames (25 ms): the forced durations' sum, else estimated
        from its phonemes at the real model's 2.53 frames each (benchmarks/gpu_kokoro.py)."""
        if self.durations is not None:
            return int(sum(self.durations))
        return max(1, round(FRAMES_PER_PHONEME * len(self.ids) / max(self.speed, 0.1)))


class ClauseQueue:
    """Bounded, earliest deadline first (ties: first come), with O(1) removal of cancelled clauses."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._heap: list[tuple[float, int, Clause]] = []
        self._live = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._live

    def push(self, clause: Clause) -> None:
        if self._live >= self.size:
            raise CapacityError(f"kokoro: {self._live} clauses already waiting (tts.queue_size)")
        clause.seq = next(self._seq)
        clause.queued = True
        clause.queued_at = time.perf_counter()
        self._live += 1
        heapq.heappush(self._heap, (clause.deadline, clause.seq, clause))

    def remove(self, clause: Clause) -> bool:
        """Forget a waiting clause (it stays in the heap until popped); False if not waiting."""
        if not clause.queued:
            return False
        clause.queued = False
        self._live -= 1
        return True

    def pop(self, n: int, max_frames: int | None = None) -> list[Clause]:
        """Up to ``n`` waiting clauses, earliest deadline first, and no more than
        ``max_frames`` frames of speech in all, but always the first: the next clause due
        is never passed over for a shorter one due later."""
        out: list[Clause] = []
        frames = 0
        while self._heap and len(out) < n:
            _, _, clause = self._heap[0]
            if not clause.queued:
                heapq.heappop(self._heap)
                continue
            if out and max_frames is not None and frames + clause.frames > max_frames:
                break
            heapq.heappop(self._heap)
            clause.queued = False
            self._live -= 1
            frames += clause.frames
            out.append(clause)
        return out


Runner = Callable[[list[Clause], Callable[[list[Clause], list[np.ndarray]], None]], "dict[str, float] | None"]
"""Synthesises a batch in a worker thread, calling ``deliver(clauses, audios)`` per finished
group; returns the seconds its phases took (:data:`PHASES`), or None."""

# A forward's phases as the torch runner times them on its thread: ``encode`` (the text
# encoder and prosody up to the frame counts), ``lock`` (waiting for the CUDA graphs, which
# one forward replays at a time), ``sync`` (waiting for its groups' audio: the GPU's work for
# this forward and what was queued on the graphs' stream before it). The rest of a forward's
# time is the host launching its decodes.
PHASES = ("encode", "lock", "sync")


@dataclass
class BatchStats:
    batches: int = 0
    clauses: int = 0
    busy_s: float = 0.0  # summed forward wall time (over all workers)
    max_batch_seen: int = 0
    dropped: int = 0  # cancelled while waiting
    discarded: int = 0  # cancelled while running
    sizes: collections.Counter[int] = field(default_factory=collections.Counter)  # forwards by clauses


# Forwards whose time and rows the TTS service reports (``forward_stats``): the last few
# hundred, so a burst's shows while it lasts, as the ASR service reports its steps.
RECENT_FORWARDS = 256


class KokoroBatcher:
    """Batches clauses of every session onto ``runner`` (see :data:`Runner`); ``max_frames``:
    the most speech one forward takes (None: ``max_batch`` clauses, however long)."""

    def __init__(self, runner: Runner, *, max_batch: int, queue_size: int, workers: int = 1,
                 max_frames: int | None = None) -> None:
        self._runner = runner
        self.max_batch = max_batch
        self.max_frames = max_frames
        self.workers = workers
        self._queue = ClauseQueue(queue_size)
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(workers)
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: set[asyncio.Future[None]] = set()
        self.stats = BatchStats()
        self._recent = RecentWork(RECENT_FORWARDS)
        self._phases = {name: RecentTimes(RECENT_FORWARDS) for name in PHASES}
        self._waits = RecentTimes(RECENT_FORWARDS)  # clauses' time in the queue
        self.failure_streak = 0
        self.last_error: BaseException | None = None

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    async def idle(self) -> None:
        """Return once no forward is running (its bookkeeping done too)."""
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
            await asyncio.sleep(0)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="tts-kokoro")
        self._task = asyncio.create_task(self._run(), name="kokoro-batcher")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        closed = EngineError("kokoro: engine closed")
        for clause in self._queue.pop(len(self._queue)):
            if not clause.future.done():
                clause.future.set_exception(closed)
                clause.future.exception()
        executor, self._executor = self._executor, None
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True)

    async def synthesize(
        self, ids: Sequence[int], style: Any, *, speed: float = 1.0, deadline: float | None = None,
        durations: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Audio of one clause; ``deadline`` (loop time) orders the queue, default now."""
        if self._task is None or self._loop is None:
            raise EngineError("kokoro: engine is not started (or already closed)")
        fut: asyncio.Future[np.ndarray] = self._loop.create_future()
        when = self._loop.time() if deadline is None else deadline
        clause = Clause(ids=ids, style=style, speed=speed, deadline=when, future=fut, durations=durations)
        self._queue.push(clause)
        self._wake.set()
        try:
            return await fut
        finally:
            if not fut.done() or fut.cancelled():
                fut.cancel()
                if self._queue.remove(clause):
                    self.stats.dropped += 1
                else:
                    self.stats.discarded += 1

    async def _run(self) -> None:
        assert self._loop is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while len(self._queue):
                await self._slots.acquire()
                batch = self._queue.pop(self.max_batch, self.max_frames)
                if not batch:
                    self._slots.release()
                    break
                popped = time.perf_counter()
                for clause in batch:
                    self._waits.add(popped - clause.queued_at)
                self.stats.batches += 1
                self.stats.clauses += len(batch)
                self.stats.sizes[len(batch)] += 1
                self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(batch))
                assert self._executor is not None
                job = self._loop.run_in_executor(self._executor, self._work, batch)
                self._running.add(job)
                job.add_done_callback(functools.partial(self._finished, batch=batch))

    def _work(self, batch: list[Clause]) -> None:  # in a worker thread
        assert self._loop is not None
        loop = self._loop
        t0 = time.perf_counter()

        def deliver(clauses: list[Clause], audios: list[np.ndarray]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
                loop.call_soon_threadsafe(self._deliver, clauses, audios)

        phases = None
        try:
            phases = self._runner(batch, deliver)
        finally:
            took = time.perf_counter() - t0
            self.stats.busy_s += took
            self._recent.add(took, len(batch))
            for name, seconds in (phases or {}).items():
                if name in self._phases:
                    self._phases[name].add(seconds)

    def forward_stats(self) -> dict[str, float]:
        """The last few hundred forwards: their wall time (p50, p95, ms: encode and every
        group's decode of one batch) and their clauses (mean); each phase's time as the runner
        reported it (``encode_ms_p95`` ...); and the last few hundred clauses' wait in the
        queue (``queue_ms_p50``, ``queue_ms_p95``). Empty before the first."""
        out = self._recent.stats("forward")
        for name, recent in (("queue", self._waits), *self._phases.items()):
            out.update(recent.stats(name))
        return out

    def _deliver(self, clauses: list[Clause], audios: list[np.ndarray]) -> None:
        self.failure_streak = 0  # audio came out: the engine works (before any awaiter resumes)
        for clause, audio in zip(clauses, audios, strict=True):
            if not clause.future.done():
                clause.future.set_result(audio)

    def _finished(self, job: asyncio.Future[None], *, batch: list[Clause]) -> None:
        self._running.discard(job)
        self._slots.release()
        exc = job.exception() if not job.cancelled() else EngineError("kokoro: forward cancelled")
        if exc is None:
            # The runner's deliveries were scheduled before this callback (same thread, in
            # order): a clause still open here was neither delivered nor cancelled.
            exc = EngineError("kokoro: the runner returned no audio for a clause")
            if all(c.future.done() for c in batch):
                return
        self.failure_streak += 1
        self.last_error = exc
        log.warning("kokoro: a batch of %d clauses failed: %s", len(batch), exc)
        err = exc if isinstance(exc, EngineError) else EngineError(f"kokoro synthesis failed: {exc}")
        for clause in batch:
            if not clause.future.done():
                clause.future.set_exception(err)
                clause.future.exception()  # its consumer may be gone


# Padded frames per vocoder forward at most: 64 sentences of ~7.5 s. Its activations peak at a
# few GB (the generator's last stage holds 128 channels x 120 samples per frame per layer).
MAX_FRAMES = 64 * 300


def torch_runner(model: Any, *, max_pad: float = 0.25, max_frames: int = MAX_FRAMES, overlap: bool = False,
                 decoder: Callable[[Sequence[Any]], list[Any]] | None = None,
                 encoder: Callable[..., list[Any]] | None = None,
                 lock_wait: Callable[[], float] | None = None) -> Runner:
    """The :data:`Runner` of a ``KModel`` (``kokoro_model.build_model``): encode the batch
    (``encoder``: ``kokoro_model.encode`` without its model argument, or a
    ``kokoro_graphs.BucketedEncoder``'s), decode it in groups of similar length
    (``decoder``: ``kokoro_model.decode`` or a ``kokoro_graphs.BucketedDecoder``'s), each
    worker thread on its own CUDA stream.

    Each group's audio goes to the host with a blocking copy: the one host-device sync of a
    group (``kokoro_model.encode`` has none with forced durations, one with predicted ones).
    ``overlap`` (CUDA only): copy each group's audio into pinned memory without blocking and
    launch the next group at once; deliver each group when its copy's event completes,
    after the last group is launched. The GPU then never waits for the host between groups,
    but the first group's audio waits for the other groups' launches.

    Returns the forward's :data:`PHASES`; ``lock_wait``: the seconds this thread waited
    for the graphs' locks since it last asked (``GraphSet.take_lock_wait``)."""
    import torch

    from voicebot.engines.tts import kokoro_model as km

    local = threading.local()
    cuda = str(model.device).startswith("cuda")
    decode = decoder or functools.partial(km.decode, model)
    encode_batch = encoder or functools.partial(km.encode, model)

    def run(batch: list[Clause], deliver: Callable[[list[Clause], list[np.ndarray]], None]) -> dict[str, float]:
        clock = time.perf_counter
        sync = 0.0
        stream = getattr(local, "stream", None)
        if cuda and stream is None:
            stream = local.stream = torch.cuda.Stream(device=model.device)
        ctx = torch.cuda.stream(stream) if cuda else contextlib.nullcontext()
        if lock_wait is not None:
            lock_wait()  # not this forward's: a failed one's may be left
        with ctx, torch.inference_mode():
            t0 = clock()
            styles = torch.stack([c.style for c in batch]).to(model.device, non_blocking=True)
            forced = [c.durations for c in batch]
            encoded = encode_batch(
                [c.ids for c in batch], styles, [c.speed for c in batch],
                None if any(d is None for d in forced) else forced,  # type: ignore[arg-type]
            )
            encode = clock() - t0
            pending = []
            for group in km.frame_groups([e.frames for e in encoded], max_pad, max_frames):
                live = [i for i in group if not batch[i].future.cancelled()]
                if not live:
                    continue
                audio = decode([encoded[i] for i in live])
                sizes = [a.shape[0] for a in audio]
                if overlap and cuda:
                    flat = torch.cat(audio).float()
                    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                    host.copy_(flat, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                    pending.append((live, sizes, host, done))
                    continue
                t1 = clock()
                flat = torch.cat(audio).float().cpu().numpy()
                sync += clock() - t1
                deliver([batch[i] for i in live], np.split(flat, np.cumsum(sizes)[:-1]))
            for live, sizes, host, done in pending:
                t1 = clock()
                done.synchronize()
                sync += clock() - t1
                deliver([batch[i] for i in live], np.split(host.numpy(), np.cumsum(sizes)[:-1]))
        phases = {"encode": encode, "sync": sync}
        if lock_wait is not None:
            phases["lock"] = lock_wait()
        return phases

    return run
