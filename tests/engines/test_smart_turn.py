"""Smart Turn v3.2 (bundle:smart-turn-v3.2) on real speech: the model, its input
features, and the semantic turn detector driven by Silero VAD as a session drives it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import pytest
from speech import Clip

from voicebot.audio import ASR_RATE
from voicebot.config import VadConfig
from voicebot.engines.turn.smart_turn import SmartTurn
from voicebot.engines.turn.vad import WINDOW, SileroVad
from voicebot.session.turns import SemanticTurnDetector, Signal

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast

# "and mister john dashwood had then leisure to consider how much there might be
# prudently in his power to do for them": a whole sentence, and the same recording
# stopped at the word gap after "... how much" (CUT_S).
SENTENCE = "0870"
CUT_S = 4.18


@pytest.fixture(scope="module")
def model(bundle_dir: Callable[[str], str]) -> SmartTurn:
    m = SmartTurn(bundle_dir("smart-turn-v3.2"))
    yield m
    m.close()


def clip(clips: list[Clip], name: str) -> np.ndarray:
    return next(c for c in clips if c.name.endswith(name)).audio


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * ASR_RATE), dtype=np.float32)


def test_features_are_whisper_log_mel_of_the_last_8_s(model: SmartTurn, speech_clips: list[Clip]) -> None:
    from transformers import WhisperFeatureExtractor

    audio = np.concatenate([clip(speech_clips, "0880"), clip(speech_clips, SENTENCE)])  # 10 s
    ours = model.features(audio)
    # What the model was trained on: transformers' extractor with chunk_length=8 on the
    # last 8 s, normalised (Pipecat's LocalSmartTurnAnalyzerV3).
    ref = WhisperFeatureExtractor(chunk_length=8)(
        audio[-8 * ASR_RATE :], sampling_rate=ASR_RATE, return_tensors="np", padding="max_length",
        max_length=8 * ASR_RATE, truncation=True, do_normalize=True,
    ).input_features[0]
    assert ours.shape == ref.shape == (80, 800)
    assert np.abs(ours - ref).max() < 1e-3, np.abs(ours - ref).max()
    # Shorter audio is padded in front: the end of the turn stays where the model looks.
    short = model.features(clip(speech_clips, "0880"))  # 3 s: the first 5 s are padding
    assert short[:, 5:450].std(axis=1).max() < 1e-3  # constant in time: no signal there
    assert short[:, -250:].std(axis=1).min() > 0.05  # the speech, at the end


def test_a_finished_sentence_scores_high_and_a_cut_one_low(model: SmartTurn, speech_clips: list[Clip]) -> None:
    sentence = clip(speech_clips, SENTENCE)
    finished = model.predict(np.concatenate([sentence, silence(0.2)]))
    cut = model.predict(np.concatenate([sentence[: int(CUT_S * ASR_RATE)], silence(0.2)]))
    assert finished > 0.8, finished
    assert cut < 0.3, cut


class Immediate:
    """The real model, answered at once (the detector's thread hop is tested with fakes)."""

    def __init__(self, model: SmartTurn) -> None:
        self.model = model
        self.answers: list[float] = []

    def submit(self, audio16k: np.ndarray) -> Future[float]:
        fut: Future[float] = Future()
        self.answers.append(self.model.predict(audio16k))
        fut.set_result(self.answers[-1])
        return fut


def last_word_end(audio: np.ndarray) -> float:
    """Seconds to the end of the last 10 ms above -40 dBFS (the probe's end of speech)."""
    frames = audio[: audio.size // 160 * 160].reshape(-1, 160)
    loud = np.flatnonzero(10 * np.log10(np.mean(frames**2, axis=1) + 1e-12) > -40)
    return float((loud[-1] + 1) * 160 / ASR_RATE)


def ends(det: SemanticTurnDetector, audio: np.ndarray) -> list[float]:
    """END times (s) when ``audio`` is streamed through Silero VAD and ``det``."""
    vad = SileroVad().stream()
    out, t = [], 0.0
    for i in range(0, audio.size - WINDOW + 1, WINDOW):
        chunk = audio[i : i + WINDOW]
        det.feed(chunk)
        for p in vad.process(chunk):
            t += WINDOW / ASR_RATE
            out += [t for s in det.update(float(p), 1000 * WINDOW / ASR_RATE) if s is Signal.END]
    return out


def test_detector_waits_through_a_mid_sentence_pause_and_ends_a_finished_turn_early(
    model: SmartTurn, speech_clips: list[Clip]
) -> None:
    sentence = clip(speech_clips, SENTENCE)
    k = int(CUT_S * ASR_RATE)
    paused = np.concatenate([silence(0.3), sentence[:k], silence(0.8), sentence[k:], silence(2.0)])
    cfg = VadConfig(turn_detector="smart_turn")  # defaults: silence alone ends turns after 400 ms
    det = SemanticTurnDetector(cfg, Immediate(model))
    got = ends(det, paused)
    end_of_speech = 0.3 + 0.8 + last_word_end(sentence)
    # One turn: not cut at the 0.8 s pause (the silence rule would cut it there) ...
    assert len(got) == 1 and got[0] > end_of_speech - 0.1, (got, end_of_speech)
    # ... and ended well before the 400 ms of silence the VAD alone waits for.
    assert got[0] - end_of_speech < 0.4, got
