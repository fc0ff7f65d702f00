"""One session's streaming utterance on the shared ASR engine (:mod:`.engine`).

:class:`Utterance` is the :class:`~voicebot.engines.contracts.AsrStream` every ASR backend
hands out: it buffers audio, asks the engine for a partial decode every
``partial_interval_ms`` of new audio (at most one queued or running per stream, which
is what keeps the engine's partial queue fair), stabilises partials with
LocalAgreement-n and decodes the final on demand. All of it runs on the event loop.

Partials are decoded with the confirmed words forced as Whisper's prefix, so a
hypothesis continues them by construction. The final is not: it is decoded from the
whole buffer as a one-shot :meth:`~.engine.AsrEngine.transcribe` would, because a word
the early partials agreed to leave out (a sentence-initial "And" a small model drops
on the first seconds of audio) could otherwise never come back. Forcing the prefix
saves nothing measurable at the final (the encoder dominates a decode;
docs/benchmarks.md). The final may therefore differ from the confirmed words; it
is the transcript. Only an utterance whose head was dropped (longer than
``max_utterance_s``) keeps its confirmed words forced: the audio under them is gone.

The two sides meet through declared seams only: the stream asks the engine for what
:class:`DecodeScheduler` lists, and the engine calls the stream back through
:class:`~voicebot.engines.asr.jobs.JobOwner` when it dispatches or finishes its jobs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

import numpy as np

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig
from voicebot.engines.asr.agreement import (
    LocalAgreement,
    continuation_after,
    join_text,
    split_words,
)
from voicebot.engines.asr.jobs import DecodeJob, Priority
from voicebot.engines.asr.partials import PartialQueue, PartialStream
from voicebot.engines.contracts import Partial, Transcript


def as_mono_f32(audio: np.ndarray) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"ASR audio must be 1-D 16 kHz mono, got shape {audio.shape}")
    return audio


class DecodeScheduler(Protocol):
    """What a stream asks of its engine (:class:`~voicebot.engines.asr.engine.AsrEngine`)."""

    cfg: AsrConfig
    agreement_n: int

    def offer_partial(self, job: DecodeJob) -> bool:
        """Queue a partial if there is room (False: dropped, ask again later)."""
        ...

    async def run_final(self, job: DecodeJob) -> tuple[str, float]:
        """Decode a final before anyone's partials: (the whole text, seconds)."""
        ...

    def abandon(self, job: DecodeJob) -> None:
        """Stop a running partial whose result nobody will use."""
        ...

    def withdraw(self, job: DecodeJob) -> bool:
        """Take a job out of the queue if it is still there (True if it was)."""
        ...

    def close_owner(self, owner: Utterance) -> None:
        """Fail every queued job of a closing stream."""
        ...


class Utterance(PartialStream):
    """One session's utterance. Not thread-safe: use it from the event loop only."""

    def __init__(self, engine: DecodeScheduler, language: str | None) -> None:
        self.engine = engine
        self.language = language
        cfg = engine.cfg
        self._interval = int(cfg.partial_interval_ms * ASR_RATE / 1000)
        # Finals only (asr.partials false): the stream never asks for a partial decode, so
        # its audio is decoded once, by finalize(); no Partial is ever yielded.
        self._partials_on = cfg.partials
        self._max_samples = int(cfg.max_utterance_s * ASR_RATE)
        self._chunks: deque[np.ndarray] = deque()
        self._samples = 0
        self._new_samples = 0  # since the last partial was scheduled
        self._agreement = LocalAgreement(n=engine.agreement_n)
        self._head_dropped = False  # audio was cut from the head (max_utterance_s)
        self._generation = 0  # bumped by reset(): results of older audio are dropped
        self._last_final_seq = 0  # partials dispatched before this final are stale
        self._partial_job: DecodeJob | None = None  # queued or running
        # The partial in flight is decoded as the final would be (see as_final below).
        self._partial_as_final = False
        self._next_as_final = False  # request_partial(covering_s) asked for one
        self._partial_settled = asyncio.Event()  # the queued/running partial finished
        self._partial_settled.set()
        # Latest partial hypothesis (full text, seconds of audio it saw, decoded as the
        # final would be): a final may reuse it when it also covers the end of speech.
        self._latest: tuple[str, float, bool] | None = None
        self.partials = PartialQueue()
        self._closed = False

    @property
    def buffered_s(self) -> float:
        return self._samples / ASR_RATE

    @property
    def confirmed(self) -> str:
        return self._agreement.confirmed_text

    def push(self, audio: np.ndarray) -> None:
        if self._closed:
            raise RuntimeError("push() on a closed ASR stream")
        audio = as_mono_f32(audio)
        if audio.size == 0:
            return
        self._chunks.append(audio.copy())  # the caller may reuse its buffer
        self._samples += audio.size
        self._new_samples += audio.size
        # Keep the *latest* audio: Whisper sees at most 30 s, and the end of the turn is
        # what is still open and what the reply answers. Words of the dropped head stay
        # confirmed (from then on they are forced in the final too); only head words not
        # yet confirmed are lost.
        while self._samples > self._max_samples:
            self._head_dropped = True
            excess = self._samples - self._max_samples
            head = self._chunks[0]
            if head.size <= excess:
                self._chunks.popleft()
                self._samples -= head.size
            else:
                self._chunks[0] = head[excess:]
                self._samples -= excess
        self._maybe_schedule_partial()

    def request_partial(self, covering_s: float | None = None) -> None:
        """Decode now rather than at the next interval (the caller just went quiet).

        With ``covering_s`` (where speech ended, as for :meth:`finalize`): not when a
        partial that saw that much audio is decoded or decoding already. The final takes
        that one, and another decode would run beside the reply's LLM prefill for nothing
        (a breath after a pause, or an interval partial that started at the last word).
        The partial asked for is decoded as the final would be (no forced prefix), so
        that it can be the final. Finals only: nothing (the final decodes at the pause).
        """
        if not self._partials_on:
            return
        if covering_s is not None:
            if self._covers(covering_s):
                return
            self._stop_stale(covering_s)  # the one that covers follows as soon as it stops
        self._next_as_final = True
        self._new_samples = max(self._new_samples, self._interval)
        self._maybe_schedule_partial()

    async def finalize(self, covering_s: float | None = None) -> Transcript:
        """The transcript of the whole buffered utterance (keeps the buffer).

        With ``covering_s`` (where speech ended, in seconds of buffered audio), a partial
        hypothesis that saw at least that much audio and was decoded as the final would
        be (no forced prefix) *is* the final: the same decode of the same audio up to the
        end of speech. It is used (awaited,
        if it is still decoding) instead of a second decode, which on a busy CPU is
        the largest part of the time between the end of speech and the reply.
        """
        if self._closed:
            raise RuntimeError("finalize() on a closed ASR stream")
        if covering_s is not None and self._stop_stale(covering_s):
            self._new_samples = 0  # no partial in its place: what follows is the final's decode
        if covering_s is not None and self.engine.cfg.partial_beam_size >= self.engine.cfg.beam_size:
            generation = self._generation
            # Wait for a running partial that covers (it is the final), or for the stopped
            # one to settle (a thread finishes its current stage first).
            while generation == self._generation:
                latest = self._latest
                if latest is not None and latest[2] and latest[1] >= covering_s:
                    return Transcript(latest[0], latest[1], 0.0)
                running = self._partial_job
                if running is None or running.audio is None:
                    break  # nothing decoding: a final decode it is
                await self._partial_settled.wait()
        queued = self._partial_job
        if queued is not None and queued.audio is None and self.engine.withdraw(queued):
            # Not started yet: the final supersedes it, and it would only compete.
            self._partial_job = None
            self._partial_settled.set()
        job = DecodeJob(
            Priority.FINAL,
            self,
            audio=self._snapshot(),
            # The prefix as of now is used only if reset() happens before dispatch.
            prefix=self._final_prefix(),
            language=self.language,
            generation=self._generation,
        )
        text, decode_s = await self.engine.run_final(job)
        assert job.audio is not None
        return Transcript(text, job.audio.size / ASR_RATE, decode_s)

    def _stop_stale(self, covering_s: float) -> bool:
        """Stop the running partial unless it can be the final: it saw ``covering_s`` and
        is decoded as the final would be (True if stopped).

        A partial that started before the end of speech (or decodes with the confirmed
        words forced) cannot be the final, and the final (or the partial that can be)
        decodes all of its audio again: stop it rather than
        wait for it. With one decode thread the final would queue behind all of it; at the
        ASR service it would wait for it and then for the partial that covers (docs/benchmarks.md,
        'Stale partial decodes'). A decode thread stops before its decoder at the latest.
        """
        running = self._partial_job
        if running is None or running.audio is None:
            return False
        if self._partial_as_final and running.audio.size / ASR_RATE >= covering_s:
            return False
        self.engine.abandon(running)
        return True

    def _covers(self, covering_s: float) -> bool:
        """A partial of this utterance that can be the final saw (or, queued, will see)
        ``covering_s`` of audio."""
        if self._latest is not None and self._latest[2] and self._latest[1] >= covering_s:
            return True
        job = self._partial_job
        if job is None:
            return False
        if job.audio is None:  # queued: it takes the buffer (and the prefix) when it starts
            return self.buffered_s >= covering_s and (self._next_as_final or self._confirmed_is_final_prefix())
        return (
            job.generation == self._generation
            and self._partial_as_final
            and job.audio.size / ASR_RATE >= covering_s
        )

    def _final_prefix(self) -> str:
        """What the final forces: nothing, unless the head's audio is gone (see the module)."""
        return self._agreement.confirmed_text if self._head_dropped else ""

    def _confirmed_is_final_prefix(self) -> bool:
        """A partial decoded now (with the confirmed words forced) is decoded as the final."""
        return self._agreement.confirmed_text == self._final_prefix()

    def reset(self) -> None:
        self._generation += 1
        self._chunks.clear()
        self._samples = self._new_samples = 0
        self._agreement.reset()
        self._head_dropped = False
        self._next_as_final = False
        self._latest = None
        running = self._partial_job
        if running is not None and self.engine.withdraw(running):
            self._partial_job = None
            self._partial_settled.set()
        elif running is not None and running.audio is not None:
            self.engine.abandon(running)  # its audio belongs to the old utterance
        self.partials.clear()  # previews of the old utterance are stale

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine.close_owner(self)
        running = self._partial_job
        if running is not None and running.audio is not None:
            self.engine.abandon(running)  # the call ended
        self._partial_job = None
        self._partial_settled.set()
        self.partials.put(None)

    # -- the engine's side (JobOwner), on the event loop ---------------------------------

    def _snapshot(self) -> np.ndarray:
        if not self._chunks:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(self._chunks)

    def _maybe_schedule_partial(self) -> None:
        if not self._partials_on or self._partial_job is not None or self._new_samples < self._interval or self._closed:
            return
        job = DecodeJob(Priority.PARTIAL, self, language=self.language)
        if self.engine.offer_partial(job):
            self._partial_job = job
            self._partial_settled.clear()
            self._new_samples = 0

    def prepare_partial(self, job: DecodeJob) -> None:
        if self._closed or job is not self._partial_job:
            return  # job.audio stays None: the worker skips it
        job.audio = self._snapshot()
        self._partial_as_final = self._next_as_final or self._confirmed_is_final_prefix()
        self._next_as_final = False
        job.prefix = self._final_prefix() if self._partial_as_final else self._agreement.confirmed_text
        job.generation = self._generation

    def final_prefix(self, job: DecodeJob) -> str:
        if job.generation != self._generation:
            return job.prefix
        # Partials dispatched before now saw less audio than this final: drop their
        # results so the confirmed words cannot grow past what the final was given.
        self._last_final_seq = job.seq
        return self._final_prefix()

    def partial_done(self, job: DecodeJob, text: str | None) -> None:
        if job is self._partial_job:
            self._partial_job = None
            self._partial_settled.set()
        fresh = job.generation == self._generation and job.seq > self._last_final_seq
        if text is not None and fresh and not self._closed and job.audio is not None:
            whole = join_text(job.prefix, text)
            self._latest = (whole, job.audio.size / ASR_RATE, job.prefix == self._final_prefix())
            confirmed = self._agreement.confirmed_text
            # Decoded without the confirmed words forced (as the final): what it has after
            # them, if it starts with them at all.
            after = text if job.prefix == confirmed else continuation_after(whole, confirmed)
            self._agreement.update(split_words(after))
            self.partials.put(
                Partial(
                    self._agreement.confirmed_text,
                    self._agreement.tentative_text,
                    job.audio.size / ASR_RATE,
                )
            )
        self._maybe_schedule_partial()

    def partial_dropped(self, job: DecodeJob) -> None:
        if job is self._partial_job:
            self._partial_job = None
            self._partial_settled.set()
            self._new_samples = max(self._new_samples, self._interval)  # retry on next push

