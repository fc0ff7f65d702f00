"""Shared streaming ASR: one faster-whisper model serving every session.

``AsrEngine`` owns the model, a bounded priority queue of decode jobs (finals before
partials, see :mod:`voicebot.engines.asr_queue`) and ``cfg.workers`` decode threads;
``AsrStream`` (:mod:`voicebot.engines.asr_stream`) is one session's utterance.

Every decode forces the confirmed words as Whisper's ``prefix``: hypotheses then start
with them by construction, and so does the final transcript.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig
from voicebot.engines.asr.agreement import continuation_after, join_text
from voicebot.engines.asr.jobs import DecodeJob, JobQueue, Priority
from voicebot.engines.asr.stream import AsrStream, as_mono_f32
from voicebot.engines.contracts import AsrStats, Transcript
from voicebot.errors import EngineError, ModelError

__all__ = ["AsrEngine", "DecodeAbandoned", "unless_abandoned"]

log = logging.getLogger(__name__)


_T = TypeVar("_T")


class DecodeAbandoned(Exception):
    """A decode stopped because nobody waits for its result any more: nothing to report."""


async def unless_abandoned(decode: asyncio.Future[_T], waiter: asyncio.Future[Any]) -> _T:
    """A final's decode, raced against its waiter: the result, or -- when the waiter goes
    first (the turn was cancelled) -- the decode cancelled, so the upstream work stops
    (a vLLM request, the ASR service's job), and :class:`DecodeAbandoned`. Our own
    cancellation cancels the decode as well and propagates."""
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


class AsrEngine:
    def __init__(self, cfg: AsrConfig, model_path: str, *, agreement_n: int = 3) -> None:
        self.cfg = cfg
        self.model_path = model_path
        # Consecutive partials that must agree before a word is confirmed. LocalAgreement-2
        # locked in tiny.en's early guesses on 1.8-2.4 s of audio ("How do you marry" for
        # "Had he married") and raised WER on the test clips from 6.7 % to 12 %; n = 3
        # keeps WER at the one-shot level at the cost of ~0.6 s more confirmation lag.
        self.agreement_n = agreement_n
        self.stats = AsrStats()
        self._model: Any = None
        self._queue: JobQueue[DecodeJob] = JobQueue(cfg.queue_size)
        self._work = asyncio.Event()  # queue may be non-empty
        self._space = asyncio.Event()  # a slot freed up (finals waiting on a full queue)
        self._workers: list[asyncio.Task[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._seq = itertools.count(1)
        self._closed = False

    async def start(self) -> None:
        # heavy import (faster-whisper), only when serving
        from voicebot.engines.asr.whisper_window import WindowedWhisper

        cfg = self.cfg
        t0 = time.perf_counter()
        try:
            self._model = await asyncio.to_thread(
                WindowedWhisper,
                self.model_path,
                device=cfg.device,
                compute_type=cfg.compute_type,
                cpu_threads=cfg.cpu_threads,
                num_workers=cfg.workers,
            )
        except Exception as exc:
            raise ModelError(f"cannot load ASR model {self.model_path!r}: {exc}") from exc
        # Own threads: decodes must not queue behind unrelated to_thread() work.
        self._executor = ThreadPoolExecutor(cfg.workers, thread_name_prefix="asr")
        self._workers = [
            asyncio.create_task(self._worker(), name=f"asr-worker-{i}") for i in range(cfg.workers)
        ]
        log.info(
            "ASR model %s loaded in %.2f s (%d workers)",
            self.model_path,
            time.perf_counter() - t0,
            cfg.workers,
        )

    async def aclose(self) -> None:
        self._closed = True
        self._space.set()  # wake finals waiting for room; they see _closed
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        while (job := self._queue.pop()) is not None:
            job.fail(EngineError("ASR engine closed"))
        if self._executor is not None:
            # Waits for at most the decodes already running (threads cannot be interrupted).
            await asyncio.to_thread(self._executor.shutdown, wait=True)
            self._executor = None
        self._model = None

    async def __aenter__(self) -> AsrEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def stream(self, *, language: str | None = None) -> AsrStream:
        """A new per-session stream; ``language=None`` means ``cfg.language``."""
        return AsrStream(self, language or self.cfg.language)

    async def transcribe(self, audio: np.ndarray, *, language: str | None = None) -> Transcript:
        """One-shot decode at final priority (no prefix, no stream state)."""
        audio = as_mono_f32(audio)
        job = DecodeJob(Priority.FINAL, None, audio=audio, language=language or self.cfg.language)
        text, decode_s = await self._run_final(job)
        return Transcript(text, audio.size / ASR_RATE, decode_s)

    # -- internals used by AsrStream -------------------------------------------------

    def _offer_partial(self, job: DecodeJob) -> bool:
        if self._closed:
            return False
        if not self._queue.offer_partial(job):
            self.stats.dropped_partials += 1
            return False
        self._work.set()
        return True

    async def _run_final(self, job: DecodeJob) -> tuple[str, float]:
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
            evicted.owner._partial_dropped(evicted)
        self._work.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            # Still queued: take it out. Running: the decode thread stops at its next
            # checkpoint, and the worker throws away whatever it returns.
            if self._queue.remove(job):
                self._space.set()
            else:
                job.stale = True
            raise

    async def _run_decode(self, job: DecodeJob) -> tuple[str, float]:
        """Decode one job: (text, seconds). Backends that decode asynchronously
        (asr_vllm.py, asr_remote.py) override this; it may raise :class:`DecodeAbandoned`,
        having done the job's bookkeeping."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._decode, job)
        except DecodeAbandoned:
            self._partial_abandoned(job)
            raise

    def _abandon(self, job: DecodeJob) -> None:
        """Stop a running partial whose result nobody will use, at the decode's earliest
        safe point (here: before the encoder or before the decoder; see whisper_window.py).
        It may still finish: then its result counts as any partial's."""
        job.stale = True

    def _partial_abandoned(self, job: DecodeJob) -> None:
        """A running job stopped by :meth:`_abandon`: settle the stream's partial."""
        if job.priority is Priority.PARTIAL and job.owner is not None:
            self.stats.abandoned_partials += 1
            job.owner._partial_done(job, None)

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
                job.owner._partial_done(job, text)

    def _dispatch(self, job: DecodeJob) -> None:
        """Fill in the job's audio and prefix at the last moment, from the stream's state."""
        job.seq = next(self._seq)
        if job.owner is None:  # one-shot transcribe()
            return
        if job.priority is Priority.FINAL:
            job.prefix = job.owner._final_prefix(job)
        else:
            job.owner._prepare_partial(job)

    def _decode(self, job: DecodeJob) -> tuple[str, float]:
        """Runs in a decode thread; returns the text after the prefix and the decode time."""
        cfg = self.cfg
        t0 = time.perf_counter()

        def checkpoint() -> None:
            if job.stale:  # set on the event loop; a bool read needs no lock
                raise DecodeAbandoned

        text = self._model.transcribe_text(
            job.audio,
            pad_s=cfg.encoder_pad_s,
            min_s=cfg.encoder_min_s,
            language=job.language,
            beam_size=cfg.beam_size if job.priority is Priority.FINAL else cfg.partial_beam_size,
            best_of=1,
            # One temperature: no fallback re-decodes, whose cost is unbounded on short audio.
            temperature=0.0,
            condition_on_previous_text=False,
            without_timestamps=True,
            vad_filter=False,  # our VAD runs upstream
            suppress_blank=True,
            prefix=job.prefix or None,
            checkpoint=checkpoint,
        )
        return continuation_after(text, job.prefix), time.perf_counter() - t0
