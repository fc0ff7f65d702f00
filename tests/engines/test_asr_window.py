"""Whisper's encoder window sized to the utterance (``asr.encoder_pad_s``).

The window arithmetic is checked alone; the engine test runs real tiny.en on a real clip
and reads the encoder's output length, which is half the frames it was given.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from speech import Clip

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig, load_config
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.asr.whisper_window import FULL_FRAMES, window_frames

ROOT = Path(__file__).resolve().parents[2]


def test_no_pad_means_the_full_30_s_window() -> None:
    assert window_frames(2 * ASR_RATE, None) == FULL_FRAMES
    assert window_frames(2 * ASR_RATE, None, 8.0) == FULL_FRAMES


def test_the_window_is_the_audio_plus_the_pad_rounded_up_to_half_a_second() -> None:
    # 2 s of audio = 201 frames (the extractor adds one hop), + 1 s = 301 -> 350.
    assert window_frames(2 * ASR_RATE, 1.0) == 350
    assert window_frames(2 * ASR_RATE, 0.0) == 250


def test_a_short_utterance_gets_the_minimum_window() -> None:
    assert window_frames(ASR_RATE // 2, 1.0, 8.0) == 800
    assert window_frames(10 * ASR_RATE, 1.0, 8.0) == 1150  # longer than the minimum: its own size


def test_the_window_never_exceeds_whispers_30_s() -> None:
    assert window_frames(29 * ASR_RATE, 2.0) == FULL_FRAMES
    assert window_frames(ASR_RATE, 1.0, 40.0) == FULL_FRAMES


def _spy_encoder(engine: AsrEngine) -> list[int]:
    """Encoder output lengths (positions) of the engine's decodes."""
    lengths: list[int] = []
    encode = engine._model.encode

    def spy(features: Any) -> Any:
        out = encode(features)
        lengths.append(int(out.shape[1]))
        return out

    engine._model.encode = spy
    return lengths


@pytest.mark.engines
@pytest.mark.parametrize(("pad", "positions"), [(None, FULL_FRAMES // 2), (1.0, 400)])
async def test_the_encoder_runs_on_the_configured_window(
    pad: float | None, positions: int, speech_clips: list[Clip], whisper_tiny_dir: str
) -> None:
    clip = next(c for c in speech_clips if c.name == "goforward")  # 2.8 s: 1 s pad, 8 s minimum
    async with AsrEngine(AsrConfig(encoder_pad_s=pad, encoder_min_s=8.0), whisper_tiny_dir) as engine:
        lengths = _spy_encoder(engine)
        result = await engine.transcribe(clip.audio)
    assert lengths == [positions]
    words = result.text.lower().replace("10", "ten").strip(" .").split()
    assert words == clip.text.split(), result.text


# ------------------------------------------------------------------ benchmarks/asr_window.py
def _asr_window_script() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import asr_window
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return asr_window


def test_the_benchmark_counts_a_question_repeated_to_the_token_limit_as_a_loop() -> None:
    bench = _asr_window_script()
    ref = bench.words("What's your name?")
    assert bench.looped(ref, bench.words("What's your name? " * 20))
    assert bench.looped(bench.words("Yes."), bench.words("Yes. " * 12))
    assert not bench.looped(ref, bench.words("What is your name?"))
    assert not bench.looped(bench.words("Yes."), bench.words("Yes, yes."))


def test_the_benchmark_model_option_replaces_asr_model_and_keeps_the_language() -> None:
    bench = _asr_window_script()
    cfg = load_config(ROOT / "configs" / "default.yaml")
    base = bench.with_model(cfg, "bundle:whisper-base")
    assert base.asr.model == "bundle:whisper-base"
    assert base.asr.language == cfg.asr.language == "en"  # a multilingual model detects no language
    assert base.asr.encoder_pad_s == cfg.asr.encoder_pad_s
    assert bench.with_model(cfg, None).asr.model == cfg.asr.model
