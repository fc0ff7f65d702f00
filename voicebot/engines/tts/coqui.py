"""Coqui TTS (VITS, XTTS) behind the TTS contract: ``tts.engine: coqui``.

The model (:mod:`.coqui_model`) synthesises a sentence as a lazy iterator of chunks: one per
sentence for VITS, one every ``tts.coqui_stream_tokens`` GPT tokens for XTTS's streaming
inference. A stream chains its sentences' iterators into one and advances it one chunk
per job of the engine's :class:`WorkerPool` (``tts.workers`` threads shared by every
session), so that:

- sessions interleave chunk by chunk, and nothing runs on the event loop;
- the next chunk is synthesised while the consumer plays the current one (one chunk of
  look-ahead per stream, as :func:`stream_jobs` keeps one sentence);
- cancelling or closing the stream stops synthesis at the next chunk boundary: the
  waiting job is dropped, a running one finishes its chunk and is discarded, and the
  iterator is never advanced again (a forward inside torch cannot be interrupted).

Audio is produced at the model's rate (``sample_rate``); the session resamples it once, as
for every engine. The package is the optional extra ``voicebot[coqui]``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import numpy as np

from voicebot.config import TtsConfig
from voicebot.engines.tts.coqui_model import CoquiModel, Voice, load_model
from voicebot.engines.tts.pool import Job, PooledTts, WorkerPool
from voicebot.engines.tts.text import clean_text, resolve_speed, split_sentences
from voicebot.errors import EngineError, ModelError

log = logging.getLogger(__name__)

# Until start() has the model: what its config.json says, else Coqui's usual rate.
DEFAULT_RATE = 22_050


def _configured_rate(ref: str) -> int:
    config = Path(ref).expanduser() / "config.json"
    try:
        audio = json.loads(config.read_text(encoding="utf-8"))["audio"]
        return int(audio.get("output_sample_rate") or audio["sample_rate"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_RATE


class CoquiTts(PooledTts):
    """A Coqui model from ``model_ref`` (a resolved ``tts.coqui_model``: a directory or a hub id)."""

    def __init__(self, cfg: TtsConfig, model_ref: str) -> None:
        self._cfg = cfg
        self._ref = model_ref
        self.sample_rate: int = _configured_rate(model_ref)
        self._pool = WorkerPool(cfg.workers, cfg.queue_size, "tts-coqui")
        self._model: CoquiModel | None = None
        self._default: Voice | None = None
        self._voice_lock = asyncio.Lock()

    async def start(self) -> None:
        cfg = self._cfg
        model = await asyncio.to_thread(load_model, self._ref, device=cfg.device, language=cfg.coqui_language,
                                        stream_tokens=cfg.coqui_stream_tokens)
        try:
            self._default = await asyncio.to_thread(model.voice, cfg.coqui_speaker)
        except EngineError as exc:  # a bad default voice is a start-up error, not one sentence's
            raise ModelError(f"tts.coqui_speaker: {exc}") from None
        self._model = model
        self.sample_rate = model.sample_rate
        self._pool.start()

    def voices(self) -> list[str]:
        """The default voice first (a clip's file stem), then the model's named speakers."""
        if self._model is None or self._default is None:
            return []
        return [self._default.name, *(s for s in self._model.speakers() if s != self._default.name)]

    async def _voice(self, name: str | None) -> Voice:
        model, default = self._model, self._default
        if model is None or default is None:
            raise EngineError("Coqui engine is not started")
        if name is None or name == default.name:
            return default
        # A new reference clip costs a forward: off the loop, one at a time.
        async with self._voice_lock:
            return await asyncio.to_thread(model.voice, name)

    async def synthesize(
        self, text: str, *, voice: str | None = None, speed: float | None = None, ahead_s: float = 0.0
    ) -> AsyncGenerator[np.ndarray, None]:
        sentences = split_sentences(clean_text(text))
        if not sentences:
            return
        model = self._model
        chosen = await self._voice(voice)
        assert model is not None
        rate = resolve_speed(speed, self._cfg.speed)
        chunks: Iterator[np.ndarray] = itertools.chain.from_iterable(
            model.stream(s, chosen, rate) for s in sentences)

        def step() -> np.ndarray | None:  # in a worker thread: one chunk's work
            return next(chunks, None)

        pending: Job | None = self._pool.submit(step)
        try:
            while pending is not None:
                audio: np.ndarray | None = await pending.future
                pending = None
                if audio is None:
                    return
                pending = self._pool.submit(step)  # the next chunk while this one plays
                if audio.size:
                    yield audio
        finally:
            if pending is not None:
                self._pool.cancel(pending)
