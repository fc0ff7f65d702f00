"""``tts.engine: kokoro`` on real Kokoro-82M weights (int8 dequantised, tests/kokoro_weights.py),
on the CPU: two sessions' sentences batched in one forward, heard back by Whisper, at each
``tts.kokoro_dtype`` this CPU has kernels for (the others refused at start)."""

from __future__ import annotations

import asyncio
import re

import jiwer
import numpy as np
import pytest
from kokoro_weights import VOICE, kokoro_int8_dir

from voicebot.audio import ASR_RATE, dbfs, resample
from voicebot.config import AsrConfig, Config, TtsConfig
from voicebot.engines.registry import create_tts
from voicebot.engines.tts import kokoro_model as km
from voicebot.engines.tts.kokoro import KokoroTts
from voicebot.errors import ConfigError

pytestmark = pytest.mark.engines

TEXTS = [
    "Yes, bicycles are allowed on this train.",
    "Folding bicycles travel free at any time, but full size bikes need a free reservation.",
]


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split())


def kokoro(dtype: str) -> KokoroTts:
    try:
        model_dir = kokoro_int8_dir()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"Kokoro weights unavailable ({type(exc).__name__}: {exc})")
    eng = create_tts(TtsConfig(engine="kokoro", voice=VOICE[0], kokoro_model=str(model_dir), device="cpu",
                               max_batch=8, kokoro_dtype=dtype), None)
    assert isinstance(eng, KokoroTts)
    return eng


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
async def test_two_sessions_batched_and_heard_back_or_the_precision_refused(dtype: str) -> None:
    """At each ``tts.kokoro_dtype``: two sessions' sentences in one forward, heard back by
    Whisper; or, on a CPU without kernels for the precision (torch's fallback takes minutes a
    clause), refused at start with an error that names it."""
    from voicebot.engines.asr.engine import AsrEngine
    from voicebot.provision import resolve_model

    tts = kokoro(dtype)
    if not km.native_precision("cpu", dtype):
        with pytest.raises(ConfigError, match=f"kokoro_dtype={dtype} needs a GPU or a CPU with {dtype} units"):
            await tts.start()
        return
    await tts.start()
    try:
        async def say(text: str) -> np.ndarray:
            async with asyncio.timeout(120):
                return np.concatenate([c async for c in tts.synthesize(text)])

        audios = await asyncio.gather(*(say(t) for t in TEXTS))
        assert tts._batcher is not None and tts._batcher.stats.max_batch_seen == 2  # one forward for both
    finally:
        await tts.aclose()
    asr = AsrEngine(AsrConfig(beam_size=1), str(resolve_model("bundle:whisper-tiny.en", Config().models)))
    await asr.start()
    try:
        for text, audio in zip(TEXTS, audios, strict=True):
            seconds = audio.size / tts.sample_rate
            assert 0.04 < seconds / len(text) < 0.12, f"{seconds:.2f} s for {len(text)} characters"
            assert dbfs(audio) > -30.0 and float(np.abs(audio).max()) <= 1.0
            heard = (await asr.transcribe(resample(audio, tts.sample_rate, ASR_RATE))).text
            wer = jiwer.wer(normalise(text), normalise(heard))
            assert wer <= 0.2, f"WER {wer:.0%}: {text!r} heard as {heard!r}"
    finally:
        await asr.aclose()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_a_precision_the_cpu_has_no_kernels_for_is_refused_before_loading(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On any CPU: as on one without them (AVX2 only), checked before the weights load."""
    monkeypatch.setattr(km, "native_precision", lambda device, precision: precision == "float32")
    eng = create_tts(TtsConfig(engine="kokoro", voice=VOICE[0], kokoro_model="/nonexistent/kokoro", device="cpu",
                               kokoro_dtype=dtype), None)
    with pytest.raises(ConfigError, match=f"kokoro_dtype={dtype}.*use float32"):
        await eng.start()


async def test_random_weights_for_gpu_measurements_speak_real_lengths() -> None:
    from voicebot.engines.tts.kokoro import RANDOM
    from voicebot.engines.tts.kokoro_model import SAMPLES_PER_FRAME

    eng = create_tts(TtsConfig(engine="kokoro", voice="any_name", kokoro_model=RANDOM, device="cpu"), None)
    assert isinstance(eng, KokoroTts)
    await eng.start()
    try:
        async with asyncio.timeout(120):
            chunks = [c async for c in eng.synthesize("Sure. Let me check that for you.")]
        assert eng.voices() == ["any_name"]
    finally:
        await eng.aclose()
    assert len(chunks) == 2
    for chunk, text in zip(chunks, ("Sure.", "Let me check that for you."), strict=True):
        ids = sum(len(p) for p in eng._g2p.ids(text))  # type: ignore[union-attr]
        frames = sum(2 + (i % 2) for i in range(ids)) + 2  # forced 2-3 per phoneme + the boundary tokens
        assert chunk.size == frames * SAMPLES_PER_FRAME
        assert 0.05 < chunk.size / 24_000 / len(text) < 0.1  # ~real speech: 14.9 characters per second
