"""A running decode whose result nobody will use stops before its decoder.

Traced on the 2-core default (docs/benchmarks.md, stop 20): the tail of the ASR final was
an interval partial that started 0-50 ms before the last word. It cannot be the final
(it did not hear the end of speech), yet the one decode thread ran all of it, encoder and
beam decoder, before the final could start: 387-504 ms of wait. ``finalize(covering_s)``
now marks it stale and the decode thread stops at its next checkpoint (before the
encoder, or between the encoder and the decoder: CTranslate2 has no other). So does
``request_partial(covering_s)`` at QUIET, where the partial that covers takes its place.

Real :class:`AsrEngine` (queue, worker, decode thread) and :class:`AsrStream`; the model
is a fake of our own ``WindowedWhisper.transcribe_text`` with an encoder stage the test
holds and releases, calling the checkpoint where the real one does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig
from voicebot.engines.asr.engine import AsrEngine

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel".split()
WAIT = 10.0  # seconds; a hang still fails


def audio(seconds: float) -> np.ndarray:
    return np.full(int(seconds * ASR_RATE), 0.01, dtype=np.float32)


class StagedWhisper:
    """``WindowedWhisper.transcribe_text`` in two stages, logged as (stage, audio seconds).

    The encoder waits for ``release`` (set: no wait); the text of N seconds of audio is
    ``WORDS[: 2N]``, prefix included, as the real model returns it."""

    def __init__(self) -> None:
        self.log: list[tuple[str, float]] = []
        self.in_encoder = threading.Event()
        self.release = threading.Event()

    def transcribe_text(
        self, audio: np.ndarray, *, pad_s: float | None, min_s: float = 0.0, checkpoint: Any = None, **options: Any
    ) -> str:
        seconds = audio.size / ASR_RATE
        if checkpoint is not None:
            checkpoint()
        self.log.append(("encoder", seconds))
        self.in_encoder.set()
        assert self.release.wait(WAIT), "the test never released the encoder"
        if checkpoint is not None:
            checkpoint()
        self.log.append(("decoder", seconds))
        return " ".join(WORDS[: int(seconds * 2)])


class StagedAsr(AsrEngine):
    """The real engine on a :class:`StagedWhisper`: one decode thread, as on the CPU default."""

    def __init__(self, cfg: AsrConfig, model: StagedWhisper) -> None:
        super().__init__(cfg, "staged-whisper", agreement_n=2)
        self.fake = model

    async def start(self) -> None:
        self._model = self.fake
        self._executor = ThreadPoolExecutor(self.cfg.workers, thread_name_prefix="asr")
        self._workers = [asyncio.create_task(self._worker()) for _ in range(self.cfg.workers)]


@asynccontextmanager
async def engine() -> AsyncIterator[tuple[StagedAsr, StagedWhisper]]:
    model = StagedWhisper()
    # configs/default.yaml's ASR scheduling: one worker, a partial per 1 s, beam 1 for both.
    cfg = AsrConfig(workers=1, partial_interval_ms=1000, beam_size=1, partial_beam_size=1)
    async with StagedAsr(cfg, model) as eng:
        yield eng, model


async def in_encoder(model: StagedWhisper) -> None:
    assert await asyncio.to_thread(model.in_encoder.wait, WAIT), "no decode started"
    model.in_encoder.clear()


async def test_a_partial_from_before_the_end_of_speech_skips_its_decoder() -> None:
    async with engine() as (eng, model):
        stream = eng.stream()
        stream.push(audio(1.0))  # the interval partial starts on the first second ...
        await in_encoder(model)
        stream.push(audio(0.5))  # ... and the caller speaks on, to 1.5 s
        final = asyncio.create_task(stream.finalize(covering_s=1.5))
        await asyncio.sleep(0)  # finalize() runs up to its first wait
        model.release.set()
        result = await asyncio.wait_for(final, WAIT)

        # The partial's decoder never ran; the final decoded all 1.5 s.
        assert model.log == [("encoder", 1.0), ("encoder", 1.5), ("decoder", 1.5)]
        assert result.text == "alpha bravo charlie"
        assert result.audio_s == pytest.approx(1.5) and result.decode_s > 0
        assert eng.stats.abandoned_partials == 1
        assert (eng.stats.partial_decodes, eng.stats.final_decodes) == (0, 1)
        # Settled: nothing running, no preview of the stopped partial, and the stream goes
        # on (a turn that resumes): the next second of audio gets its partial.
        assert stream._partial_job is None and stream._partial_settled.is_set()
        stream.push(audio(1.0))
        partial = await asyncio.wait_for(anext(stream), WAIT)
        assert partial.audio_s == pytest.approx(2.5)
        assert partial.text == "alpha bravo charlie delta echo"
        await stream.aclose()


async def test_quiet_stops_the_stale_partial_and_the_covering_one_becomes_the_final() -> None:
    # The session asks for a partial at QUIET (request_partial(covering_s)), ~130 ms before
    # it asks for the final at PAUSE: the stale partial is stopped there already, and the
    # partial that covers runs in its place and is the final.
    async with engine() as (eng, model):
        stream = eng.stream()
        stream.push(audio(1.0))
        await in_encoder(model)
        stream.push(audio(0.5))
        stream.request_partial(covering_s=1.5)  # QUIET
        model.release.set()
        partial = await asyncio.wait_for(anext(stream), WAIT)
        assert partial.audio_s == pytest.approx(1.5)
        result = await asyncio.wait_for(stream.finalize(covering_s=1.5), WAIT)  # PAUSE
        assert result.text == "alpha bravo charlie" and result.decode_s == 0.0  # the partial, reused
        assert model.log == [("encoder", 1.0), ("encoder", 1.5), ("decoder", 1.5)]
        assert eng.stats.abandoned_partials == 1
        assert (eng.stats.partial_decodes, eng.stats.final_decodes) == (1, 0)
        await stream.aclose()


async def test_a_partial_that_heard_the_end_of_speech_is_not_stopped() -> None:
    async with engine() as (eng, model):
        stream = eng.stream()
        stream.push(audio(1.0))  # the partial starts at the last word: it is the final
        await in_encoder(model)
        final = asyncio.create_task(stream.finalize(covering_s=1.0))
        await asyncio.sleep(0)
        model.release.set()
        result = await asyncio.wait_for(final, WAIT)
        assert model.log == [("encoder", 1.0), ("decoder", 1.0)]
        assert result.text == "alpha bravo" and result.decode_s == 0.0  # reused
        assert eng.stats.abandoned_partials == 0 and eng.stats.partial_decodes == 1
        await stream.aclose()


async def test_reset_stops_the_old_utterances_partial_and_the_stream_goes_on() -> None:
    async with engine() as (eng, model):
        stream = eng.stream()
        stream.push(audio(1.0))
        await in_encoder(model)
        stream.reset()  # a new utterance: the running partial's audio is gone
        model.release.set()
        stream.push(audio(1.0))
        partial = await asyncio.wait_for(anext(stream), WAIT)
        assert partial.text == "alpha bravo" and partial.audio_s == pytest.approx(1.0)
        assert model.log == [("encoder", 1.0), ("encoder", 1.0), ("decoder", 1.0)]
        assert eng.stats.abandoned_partials == 1 and eng.stats.partial_decodes == 1
        await stream.aclose()


async def test_a_cancelled_final_stops_before_its_decoder() -> None:
    async with engine() as (eng, model):
        stream = eng.stream()
        stream._chunks.append(audio(1.5))  # audio without scheduling a partial
        stream._samples = audio(1.5).size
        final = asyncio.create_task(stream.finalize())
        await in_encoder(model)
        final.cancel()  # the turn went away while the final was in the encoder
        with pytest.raises(asyncio.CancelledError):
            await final
        model.release.set()
        # The worker goes on: the next final is decoded.
        result = await asyncio.wait_for(stream.finalize(), WAIT)
        assert result.text == "alpha bravo charlie"
        assert model.log == [("encoder", 1.5), ("encoder", 1.5), ("decoder", 1.5)]
        assert eng.stats.final_decodes == 1 and eng.stats.abandoned_partials == 0
        await stream.aclose()
