"""``tts.engine: coqui`` through the TTS contract, on a VITS model built here from Coqui's own
config with random weights (tests/coqui_weights.py): no download.

Random weights make noise, not speech: these tests check the rate, the length and the
timing of the audio, never its words. The model forces every token to 3 frames of 256
samples, so each sentence's length is exact. A missing ``coqui-tts`` package fails them
(``pip install 'voicebot[coqui]'``); nothing is skipped.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from coqui_weights import FRAMES, HOP, RATE, jobs_when_closed_at_the_first_chunk, tiny_vits, tokens

from voicebot.config import TtsConfig
from voicebot.engines.registry import create_tts
from voicebot.engines.tts.coqui import CoquiTts
from voicebot.errors import EngineError, ModelError

pytestmark = pytest.mark.engines

TWO = "Hello there, how are you today? I am fine."
LONG = " ".join(f"This is sentence number {n} of a reply that goes on." for n in range(1, 13))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return tiny_vits(tmp_path_factory.mktemp("coqui") / "vits-tiny")
    except ImportError as exc:
        pytest.fail(f"coqui-tts is not installed ({exc}): pip install 'voicebot[coqui]'")


async def started(model_dir: Path | str, **cfg: object) -> CoquiTts:
    engine = create_tts(TtsConfig(engine="coqui", coqui_model=str(model_dir), device="cpu", **cfg),  # type: ignore[arg-type]
                        str(model_dir))
    assert isinstance(engine, CoquiTts)
    await engine.start()
    return engine


@pytest.fixture(scope="module")
async def tts(model_dir: Path) -> AsyncIterator[CoquiTts]:
    engine = await started(model_dir, workers=1)
    yield engine
    await engine.aclose()


def samples(model_dir: Path, sentence: str, frames: int = FRAMES) -> int:
    return tokens(model_dir, sentence) * frames * HOP


async def collect(tts: CoquiTts, text: str, **kw: object) -> list[np.ndarray]:
    async with asyncio.timeout(60):
        return [c async for c in tts.synthesize(text, **kw)]  # type: ignore[arg-type]


async def test_a_clause_comes_out_sentence_by_sentence_at_the_models_rate_and_length(
    tts: CoquiTts, model_dir: Path
) -> None:
    assert tts.sample_rate == RATE == json.loads((model_dir / "config.json").read_text())["audio"]["sample_rate"]
    chunks = await collect(tts, TWO)
    expected = [samples(model_dir, "Hello there, how are you today?"), samples(model_dir, "I am fine.")]
    assert [c.size for c in chunks] == expected  # one chunk per sentence, each of its exact length
    for chunk in chunks:
        assert chunk.dtype == np.float32 and chunk.ndim == 1
        assert np.isfinite(chunk).all() and np.abs(chunk).max() > 0  # noise, but sound
    assert tts.voices() == ["default"]  # a single-speaker model: its one voice
    assert tts.failure_streak == 0 and tts.queue_depth == 0


async def test_speed_scales_the_length_per_call(tts: CoquiTts, model_dir: Path) -> None:
    sentence = "Hello there, how are you today?"
    fast = await collect(tts, sentence, speed=2.0)
    # length_scale 1/2: 1.25 frames a token, rounded up to 2
    assert [c.size for c in fast] == [samples(model_dir, sentence, frames=2)]
    normal = await collect(tts, sentence)  # the speed of one call does not leak into the next
    assert [c.size for c in normal] == [samples(model_dir, sentence)]


async def test_nothing_speakable_yields_nothing(tts: CoquiTts) -> None:
    assert await collect(tts, "  **  ") == []


async def test_closing_a_clause_mid_way_stops_its_synthesis(tts: CoquiTts) -> None:
    # The sentence handed over and at most the one synthesised ahead of it: of twelve.
    assert await jobs_when_closed_at_the_first_chunk(tts, LONG) <= 2


async def test_cancelling_the_consumer_cancels_the_stream(tts: CoquiTts) -> None:
    got: list[np.ndarray] = []

    async def consume() -> None:
        async for chunk in tts.synthesize(LONG):
            got.append(chunk)

    task = asyncio.create_task(consume())
    async with asyncio.timeout(60):
        while not got:
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):  # the cancellation goes on up, never swallowed
        await task
    async with asyncio.timeout(30):
        while tts.pool.running:
            await asyncio.sleep(0.01)
    assert len(got) < 12 and tts.queue_depth == 0


async def test_two_calls_at_once_both_get_all_their_audio(model_dir: Path) -> None:
    tts = await started(model_dir, workers=2)
    try:
        one, two = await asyncio.gather(collect(tts, TWO), collect(tts, LONG))
        assert [c.size for c in one] == [samples(model_dir, "Hello there, how are you today?"),
                                         samples(model_dir, "I am fine.")]
        assert len(two) == 12 and all(c.size > 0 for c in two)
    finally:
        await tts.aclose()


async def test_an_unknown_voice_is_one_calls_error(tts: CoquiTts) -> None:
    with pytest.raises(EngineError, match="unknown Coqui voice"):
        await collect(tts, TWO, voice="nobody")
    assert len(await collect(tts, TWO)) == 2  # the engine goes on


async def test_a_bad_model_is_a_clear_start_up_error(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        await started(tmp_path / "missing")
    with pytest.raises(ModelError, match="no config.json"):
        await started(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    (broken / "model.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match="cannot load Coqui model"):
        await started(broken)
    with pytest.raises(ModelError, match="coqui_speaker"):  # a default voice the model does not have
        await started(model_dir, coqui_speaker="nobody")


async def test_a_multi_speaker_model_speaks_with_the_speaker_each_call_picks(tmp_path: Path) -> None:
    trained = tiny_vits(tmp_path / "trained", speakers=["ann", "bob"])
    # A directory moved from where it was made: its config still names the old speaker_ids.json.
    moved = Path(shutil.move(trained, tmp_path / "moved"))
    tts = await started(moved, coqui_speaker="bob")
    try:
        assert tts.voices() == ["bob", "ann"]  # the default first
        sentence = "Hello there, how are you today?"
        for voice in (None, "ann", "bob"):
            chunks = await collect(tts, sentence, voice=voice)
            assert [c.size for c in chunks] == [samples(moved, sentence)]
        with pytest.raises(EngineError, match="speakers: ann, bob"):
            await collect(tts, sentence, voice="carol")
    finally:
        await tts.aclose()
