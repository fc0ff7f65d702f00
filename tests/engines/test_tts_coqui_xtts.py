"""``tts.engine: coqui`` on an XTTS model, through the TTS contract: XTTS's own streaming
inference (a chunk every ``tts.coqui_stream_tokens`` GPT tokens), a reference clip as the
speaker, per call, and cancellation mid-sentence.

The model is built here from Coqui's own ``XttsConfig`` with random weights
(tests/coqui_weights.py ``tiny_xtts``): no download. Random weights make noise, not speech:
these tests check the rate, the chunking and the length of the audio, never its words. Every
sentence is ``XTTS_TOKENS`` GPT tokens and the tokens are the argmax, so a sentence in one
voice is the same audio every time. The reference clips are the test speech
(tests/speech.py). A missing ``coqui-tts`` package fails them; nothing is skipped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from coqui_weights import XTTS_RATE, XTTS_TOKENS, jobs_when_closed_at_the_first_chunk, tiny_xtts
from speech import Clip

from voicebot.config import TtsConfig
from voicebot.engines.registry import create_tts
from voicebot.engines.tts.coqui import CoquiTts
from voicebot.errors import EngineError, ModelError

pytestmark = pytest.mark.engines

SENTENCE = "Hello there, how are you today?"
STREAM_TOKENS = 4  # GPT tokens a chunk: XTTS_TOKENS // 4 chunks, then the sentence's tail


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return tiny_xtts(tmp_path_factory.mktemp("coqui") / "xtts-tiny")
    except ImportError as exc:
        pytest.fail(f"coqui-tts is not installed ({exc}): pip install 'voicebot[coqui]'")


async def started(model_dir: Path, speaker: str | None, **cfg: object) -> CoquiTts:
    engine = create_tts(TtsConfig(engine="coqui", model=str(model_dir), coqui_speaker=speaker, device="cpu",  # type: ignore[arg-type]
                                  **cfg), str(model_dir))
    assert isinstance(engine, CoquiTts)
    await engine.start()
    return engine


@pytest.fixture(scope="module")
async def tts(model_dir: Path, speech_clips: list[Clip]) -> AsyncIterator[CoquiTts]:
    engine = await started(model_dir, str(speech_clips[0].path), coqui_stream_tokens=STREAM_TOKENS)
    yield engine
    await engine.aclose()


async def collect(tts: CoquiTts, text: str, **kw: object) -> list[np.ndarray]:
    async with asyncio.timeout(120):
        return [c async for c in tts.synthesize(text, **kw)]  # type: ignore[arg-type]


async def test_a_sentence_streams_in_chunks_that_add_up_to_it_at_24_khz(
    tts: CoquiTts, model_dir: Path, speech_clips: list[Clip]
) -> None:
    assert tts.sample_rate == XTTS_RATE == json.loads((model_dir / "config.json").read_text())["audio"]["output_sample_rate"]
    assert tts.voices() == [speech_clips[0].path.stem]  # the default clip's name; XTTS has no named speakers here
    chunks = await collect(tts, SENTENCE)
    # A chunk every STREAM_TOKENS tokens while the GPT runs, then the tail it kept for the crossfade.
    assert len(chunks) == XTTS_TOKENS // STREAM_TOKENS + 1, [c.size for c in chunks]
    for chunk in chunks:
        assert chunk.dtype == np.float32 and chunk.ndim == 1 and chunk.size > 0
        assert np.isfinite(chunk).all() and np.abs(chunk).max() > 0  # noise, but sound
    # The same sentence decoded at once (coqui_stream_tokens 0) is as long as its chunks together.
    whole = await started(model_dir, str(speech_clips[0].path), coqui_stream_tokens=0)
    try:
        (one,) = await collect(whole, SENTENCE)
    finally:
        await whole.aclose()
    assert sum(c.size for c in chunks) == one.size
    # Two sentences: each streams on its own.
    assert len(await collect(tts, f"{SENTENCE} I am fine.")) == 2 * len(chunks)
    assert tts.failure_streak == 0 and tts.queue_depth == 0


async def test_each_call_speaks_with_the_reference_clip_it_names(tts: CoquiTts, speech_clips: list[Clip]) -> None:
    default = np.concatenate(await collect(tts, SENTENCE))
    same = np.concatenate(await collect(tts, SENTENCE, voice=str(speech_clips[0].path)))
    other = np.concatenate(await collect(tts, SENTENCE, voice=str(speech_clips[1].path)))
    assert np.array_equal(default, same)  # the default voice is that clip's
    assert other.size == default.size and not np.allclose(other, default)  # another speaker, same length
    again = np.concatenate(await collect(tts, SENTENCE))
    assert np.array_equal(again, default)  # one call's voice does not leak into the next
    with pytest.raises(EngineError, match="unknown Coqui voice"):
        await collect(tts, SENTENCE, voice=str(speech_clips[0].path.with_name("nobody.wav")))


async def test_closing_a_sentence_mid_way_stops_its_synthesis(tts: CoquiTts) -> None:
    # The chunk handed over and at most the one synthesised ahead of it, of the sentence's five.
    assert await jobs_when_closed_at_the_first_chunk(tts, SENTENCE) <= 2
    assert len(await collect(tts, SENTENCE)) == XTTS_TOKENS // STREAM_TOKENS + 1  # the engine goes on


async def test_an_xtts_model_without_a_voice_is_a_clear_start_up_error(model_dir: Path) -> None:
    with pytest.raises(ModelError, match=r"no named speakers: set tts.coqui_speaker to a reference clip"):
        await started(model_dir, None)
