"""Streaming Silero VAD v6 on real speech, silence and noise."""

from __future__ import annotations

import numpy as np
import pytest

from voicebot.audio import ASR_RATE
from voicebot.engines.turn.vad import WINDOW, SileroVad, default_model_path

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast


@pytest.fixture(scope="module")
def vad() -> SileroVad:
    path = default_model_path()
    assert path.is_file(), f"Silero VAD missing at {path}: reinstall faster-whisper==1.2.1"
    return SileroVad(path)


def stream_probs(vad: SileroVad, audio: np.ndarray, chunk: int = 320) -> np.ndarray:
    """Feed 20 ms chunks (not a multiple of the 512-sample window) like a session does."""
    stream = vad.stream()
    parts = [stream.process(audio[i : i + chunk]) for i in range(0, audio.size, chunk)]
    return np.concatenate(parts)


def librivox(clips: list) -> list:
    clips = [c for c in clips if "austen" in c.name]
    assert len(clips) == 5, "expected the five LibriVox clips"
    return clips


def test_speech_scores_high(vad: SileroVad, speech_clips: list) -> None:
    for clip in librivox(speech_clips):
        probs = stream_probs(vad, clip.audio)
        assert probs.size == clip.audio.size // WINDOW
        # The clips are trimmed read speech: most windows are speech; pauses between
        # words and phrases account for the rest.
        assert np.mean(probs > 0.5) > 0.7, (clip.name, np.round(probs, 2))
        assert np.median(probs) > 0.9, clip.name


def test_silence_and_low_noise_score_low(vad: SileroVad) -> None:
    silence = np.zeros(3 * ASR_RATE, dtype=np.float32)
    assert stream_probs(vad, silence).max() < 0.1
    noise = np.random.default_rng(0).normal(0.0, 10 ** (-50 / 20), 3 * ASR_RATE)  # -50 dBFS
    assert stream_probs(vad, noise.astype(np.float32)).max() < 0.2


def test_silence_then_speech_then_silence(vad: SileroVad, speech_clips: list) -> None:
    clip = librivox(speech_clips)[1]
    gap = np.zeros(ASR_RATE, dtype=np.float32)
    probs = stream_probs(vad, np.concatenate([gap, clip.audio, gap]))
    per_s = ASR_RATE // WINDOW  # 31 windows per second
    assert probs[: per_s - 1].max() < 0.1  # leading second of silence
    assert probs[-per_s // 2 :].max() < 0.5  # the model lets go within half a second
    assert probs[per_s:-per_s].mean() > 0.7


def test_chunking_does_not_change_the_result(vad: SileroVad, speech_clips: list) -> None:
    """State, context and remainder carried across calls: any chunking gives the same output."""
    audio = librivox(speech_clips)[0].audio
    whole = vad.stream().process(audio)
    for chunk in (160, 320, 512, 1000, 4096):
        np.testing.assert_allclose(stream_probs(vad, audio, chunk), whole, atol=1e-4)


def test_streams_are_independent_and_reset_restores_a_fresh_state(
    vad: SileroVad, speech_clips: list
) -> None:
    a, b = (c.audio for c in librivox(speech_clips)[:2])
    expect_a, expect_b = vad.stream().process(a), vad.stream().process(b)
    sa, sb = vad.stream(), vad.stream()
    got_a, got_b = [], []
    for i in range(0, max(a.size, b.size), 320):  # interleaved on the one shared session
        got_a.append(sa.process(a[i : i + 320]))
        got_b.append(sb.process(b[i : i + 320]))
    np.testing.assert_allclose(np.concatenate(got_a), expect_a, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(got_b), expect_b, atol=1e-4)
    sa.reset()
    np.testing.assert_allclose(sa.process(b), expect_b, atol=1e-4)


# What a window costs the event loop is measured (docs/benchmarks.md, ~0.15 ms on an idle
# core), not asserted here: a test's wall clock on a loaded machine says nothing.
