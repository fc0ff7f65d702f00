"""Smart Turn v3.2: does the caller's turn *sound* finished? (bundle:smart-turn-v3.2)

An end-of-turn classifier by Daily (BSD-2-Clause, shipped in the ``pipecat-ai`` wheel;
only the ONNX file and its licence are taken): a Whisper-tiny encoder reading the last
8 s of the turn, returning the probability that the speaker has finished. It hears
intonation and grammar, so "I'd like to order, um," scores low and "that's all." high.

Inputs, as the model was trained (Pipecat's ``LocalSmartTurnAnalyzerV3``):
16 kHz mono, the last 8 s of the turn (left-padded with zeros when shorter),
zero-mean unit-variance normalised, then Whisper's 80-bin log-mel spectrogram
(n_fft 400, hop 160: 800 frames), fed as ``input_features`` (batch, 80, 800); the
output ``logits`` is already a sigmoid probability. Pipecat calls it complete above 0.5.

The log-mel is faster-whisper's own numpy implementation (the same one Whisper
decoding uses here), so nothing beyond onnxruntime and numpy is needed.

One model and one inference thread serve every session: an inference takes tens of
milliseconds of one core, and runs only at a pause, so a single thread keeps it off the event loop
without taking both cores from ASR and the LLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from voicebot.audio import ASR_RATE
from voicebot.config import Config
from voicebot.errors import ModelError

log = logging.getLogger(__name__)

MODEL_FILE = "smart-turn-v3.2-cpu.onnx"
WINDOW_S = 8  # seconds of audio the model reads (its input is 800 frames of 10 ms)
_SAMPLES = WINDOW_S * ASR_RATE
_NORM_EPS = 1e-7  # transformers' WhisperFeatureExtractor variance floor


def model_file(path: str | Path) -> Path:
    """The ONNX file inside a model directory (or the file itself)."""
    p = Path(path)
    return p / MODEL_FILE if p.is_dir() else p


class SmartTurn:
    """The shared Smart Turn model. ``submit`` runs an inference on its own thread."""

    def __init__(self, path: str | Path, *, threads: int = 1) -> None:
        import onnxruntime as ort
        from faster_whisper.feature_extractor import FeatureExtractor

        file = model_file(path)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(str(file), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ModelError(f"cannot load Smart Turn from {file}: {exc}") from exc
        inputs = {i.name: i.shape for i in self._session.get_inputs()}
        if list(inputs) != ["input_features"] or list(inputs["input_features"][1:]) != [80, 800]:
            raise ModelError(f"{file}: not a Smart Turn v3 graph (inputs {inputs})")
        self._mel = FeatureExtractor(feature_size=80, sampling_rate=ASR_RATE, hop_length=160, chunk_length=WINDOW_S, n_fft=400)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="smart-turn")
        self.path = str(file)

    def features(self, audio16k: np.ndarray) -> np.ndarray:
        """(80, 800) log-mel of the last 8 s, as the model was trained on."""
        audio = np.asarray(audio16k, dtype=np.float32).reshape(-1)[-_SAMPLES:]
        if audio.size < _SAMPLES:  # short turns: silence in front, the end stays at the end
            audio = np.concatenate([np.zeros(_SAMPLES - audio.size, dtype=np.float32), audio])
        audio = (audio - audio.mean()) / np.sqrt(audio.var() + _NORM_EPS)
        mel: np.ndarray = self._mel(audio, padding=0)
        return mel.astype(np.float32, copy=False)

    def predict(self, audio16k: np.ndarray) -> float:
        """P(turn complete) for the audio of a turn ending now (blocking; any thread)."""
        feats = self.features(audio16k)[None]
        (out,) = self._session.run(None, {"input_features": feats})
        return float(np.asarray(out).reshape(-1)[0])

    def submit(self, audio16k: np.ndarray) -> Future[float]:
        """``predict`` on the model's thread; the caller polls or awaits the future."""
        audio = np.array(audio16k, dtype=np.float32, copy=True)  # the caller keeps its buffer
        return self._executor.submit(self._timed, audio)

    def _timed(self, audio: np.ndarray) -> float:
        t0 = time.perf_counter()
        p = self.predict(audio)
        log.debug("smart turn: p=%.3f in %.1f ms on %.2f s", p, 1000 * (time.perf_counter() - t0), audio.size / ASR_RATE)
        return p

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


async def load_smart_turn(cfg: Config) -> SmartTurn | None:
    """The model ``vad.turn_detector: smart_turn`` needs (None for 'silence'), loaded
    off the event loop; ``bundle:`` references are built on first use like every model."""
    if cfg.vad.turn_detector != "smart_turn":
        return None
    from voicebot.provision import resolve_model

    path = await asyncio.to_thread(resolve_model, cfg.vad.smart_turn_model, cfg.models)
    model = await asyncio.to_thread(SmartTurn, path)
    log.info("Smart Turn end-of-turn model loaded from %s", model.path)
    return model
