"""Shared streaming ASR: one engine serving every session's streams.

``AsrEngine`` owns a bounded priority queue of decode jobs (finals before partials, see
:mod:`.jobs`) and as many decode slots as its :class:`~.jobs.Decoder` runs at once; an
:class:`~.stream.Utterance` is one session's stream. The decoder is the backend:
faster-whisper on threads (:mod:`.local`, the default), Whisper on vLLM
(:mod:`.vllm_whisper`) or the shared ASR service (:mod:`.remote`); everything else --
queueing, partial scheduling, LocalAgreement, reuse of the partial that saw the end of
speech -- is this engine's and the stream's, whichever decodes.

Every partial decode forces the confirmed words as Whisper's ``prefix``: hypotheses then
start with them by construction. The final is decoded without it, as :meth:`AsrEngine.transcribe`
decodes (the stream's module says why).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig
from voicebot.engines.asr.agreement import join_text
from voicebot.engines.asr.jobs import (
    DecodeAbandoned,
    DecodeDropped,
    DecodeFailed,
    DecodeJob,
    Decoder,
    JobOwner,
    JobQueue,
    Priority,
)
from voicebot.engines.asr.local import LocalWhisper
from voicebot.engines.asr.loop_guard import LoopGuard
from voicebot.engines.asr.stream import Utterance, as_mono_f32
from voicebot.engines.contracts import AsrStats, Transcript
from voicebot.errors import EngineError, LateLoopTimeout

__all__ = ["AsrEngine"]

log = logging.getLogger(__name__)


class AsrEngine:
    """The :class:`~voicebot.engines.contracts.Asr` contract over a :class:`~.jobs.Decoder`
    (faster-whisper on ``cfg.workers`` threads when none is given)."""

    def __init__(
        self, cfg: AsrConfig, model_path: str, *, agreement_n: int = 3, decoder: Decoder | None = None
    ) -> None:
        self.cfg = cfg
        self.model_path = model_path
        # Consecutive partials that must agree before a word is confirmed. LocalAgreement-2
        # locks in a small model's early guesses on the first seconds of audio; n = 3 keeps
        # WER at the one-shot level for one more partial of confirmation lag.
        self.agreement_n = agreement_n
        # Every decode, of every backend, goes through the loop guard (loop_guard.py).
        self.decoder = LoopGuard(decoder or LocalWhisper(cfg, model_path), tuple(cfg.loop_fallback_temperatures))
        self.stats = AsrStats()
        self._queue: JobQueue[DecodeJob] = JobQueue(cfg.queue_size)
        self._work = asyncio.Event()  # queue may be non-empty
        self._space = asyncio.Event()  # a slot freed up (finals waiting on a full queue)
        self._workers: list[asyncio.Task[None]] = []
        self._seq = itertools.count(1)
        self._closed = False

    async def start(self) -> None:
        await self.decoder.start()
        # One task per decode slot: each takes the next job (finals first) and awaits
        # the decoder. The decoder bounds nothing itself: this count does.
        self._workers = [
            asyncio.create_task(self._worker(), name=f"{self.decoder.name}-{i}") for i in range(self.decoder.slots)
        ]

    async def aclose(self) -> None:
        self._closed = True
        self._space.set()  # wake finals waiting for room; they see _closed
        try:
            for task in self._workers:
                task.cancel()  # a vLLM request or a service decode in flight is aborted
            await asyncio.gather(*self._workers, return_exceptions=True)
            self._workers = []
            while (job := self._queue.pop()) is not None:
                job.fail(EngineError("ASR engine closed"))
        finally:
            await self.decoder.aclose()

    async def __aenter__(self) -> AsrEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def stream(self, *, language: str | None = None) -> Utterance:
        """A new per-session stream; ``language=None`` means ``cfg.language``."""
        return Utterance(self, language or self.cfg.language)

    async def transcribe(self, audio: np.ndarray, *, language: str | None = None) -> Transcript:
        """One-shot decode at final priority (no prefix, no stream state)."""
        audio = as_mono_f32(audio)
        job = DecodeJob(Priority.FINAL, None, audio=audio, language=language or self.cfg.language)
        text, decode_s = await self.run_final(job)
        return Transcript(text, audio.size / ASR_RATE, decode_s)

    # -- what a stream asks of the engine (stream.DecodeScheduler) -------------------

    def offer_partial(self, job: DecodeJob) -> bool:
        if self._closed:
            return False
        if not self._queue.offer_partial(job):
            self.stats.dropped_partials += 1
            return False
        self._work.set()
        return True

    async def run_final(self, job: DecodeJob) -> tuple[str, float]:
        job.future = asyncio.get_running_loop().create_future()
        while True:
            if self._closed or not self._workers:
                raise EngineError("ASR engine is not running")
            if self._queue.can_take_final():
                break
            self._space.clear()
            await self._space.wait()
        evicted = self._queue.put_final(job)
        if evicted is not None:
            self.stats.dropped_partials += 1
            assert evicted.owner is not None
            evicted.owner.partial_dropped(evicted)
        self._work.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            # Still queued: take it out. Running: the decode stops at its next checkpoint
            # (or its request is aborted), and the worker throws away whatever it returns.
            if self._queue.remove(job):
                self._space.set()
            else:
                job.stale = True
            raise

    def abandon(self, job: DecodeJob) -> None:
        """Stop a running partial whose result nobody will use, at the decode's earliest
        safe point. It may still finish: then its result counts as any partial's."""
        job.stale = True
        self.decoder.abandon(job)

    def withdraw(self, job: DecodeJob) -> bool:
        return self._queue.remove(job)

    def close_owner(self, owner: JobOwner) -> None:
        for job in self._queue.remove_owner(owner):
            job.fail(EngineError("ASR stream closed"))
        self._space.set()

    # -- the decode slots ------------------------------------------------------------

    async def _run_decode(self, job: DecodeJob) -> tuple[str, float]:
        """Decode one job: (text, seconds), or :class:`DecodeAbandoned` once the job's
        bookkeeping is done (its stream's partial settled, the counters updated)."""
        try:
            return await self.decoder.decode(job)
        except DecodeAbandoned:
            if job.priority is Priority.PARTIAL and job.owner is not None:
                self.stats.abandoned_partials += 1
                job.owner.partial_done(job, None)
            raise
        except DecodeDropped:
            self.stats.dropped_partials += 1
            if job.owner is not None:
                job.owner.partial_dropped(job)  # retried on the stream's next audio
            raise DecodeAbandoned from None
        except DecodeFailed:
            self.stats.failed_decodes += 1
            if job.owner is not None:
                job.owner.partial_done(job, None)
            raise DecodeAbandoned from None

    async def _worker(self) -> None:
        while True:
            job = self._queue.pop()
            if job is None:
                self._work.clear()
                await self._work.wait()
                continue
            self._space.set()
            if job.future is not None and job.future.done():
                continue  # cancelled while queued
            self._dispatch(job)
            if job.audio is None:
                continue  # a partial that went stale while queued
            try:
                text, decode_s = await self._run_decode(job)
            except asyncio.CancelledError:
                job.fail(EngineError("ASR engine closed"))
                raise
            except DecodeAbandoned:
                continue
            except LateLoopTimeout as exc:  # our late loop's timeout: the call's error, not the engine's failure
                log.warning("ASR decode failed: %s", exc)
                job.fail(exc)
                continue
            except Exception as exc:
                self.stats.failed_decodes += 1
                log.warning("ASR decode failed: %s", exc, exc_info=True)
                job.fail(exc if isinstance(exc, EngineError) else EngineError(f"ASR decode failed: {exc}"))
                continue
            if job.priority is Priority.FINAL:
                self.stats.final_decodes += 1
                assert job.future is not None
                if not job.future.done():
                    job.future.set_result((join_text(job.prefix, text), decode_s))
            else:
                self.stats.partial_decodes += 1
                assert job.owner is not None
                job.owner.partial_done(job, text)

    def _dispatch(self, job: DecodeJob) -> None:
        """Fill in the job's audio and prefix at the last moment, from the stream's state."""
        job.seq = next(self._seq)
        if job.owner is None:  # one-shot transcribe()
            return
        if job.priority is Priority.FINAL:
            job.prefix = job.owner.final_prefix(job)
        else:
            job.owner.prepare_partial(job)

    # -- faster-whisper's model and threads, which tests that stage a decode set ------

    @property
    def _model(self) -> Any:
        return self._local().model

    @_model.setter
    def _model(self, model: Any) -> None:
        self._local().model = model

    @property
    def _executor(self) -> ThreadPoolExecutor | None:
        return self._local().executor

    @_executor.setter
    def _executor(self, executor: ThreadPoolExecutor | None) -> None:
        self._local().executor = executor

    def _local(self) -> LocalWhisper:
        local = self.decoder.inner
        if not isinstance(local, LocalWhisper):
            raise AttributeError(f"{type(local).__name__} is not faster-whisper on threads")
        return local
