"""Streaming Silero VAD (v6 ONNX, shipped inside the faster-whisper wheel).

``SileroVad`` holds the one onnxruntime session all sessions share; ``VadStream`` is one
session's state. The v6 graph takes ``input`` of shape (windows, 64 + 512) — each
512-sample window (32 ms at 16 kHz) preceded by the last 64 samples of the window
before it — plus LSTM state ``h`` and ``c`` of shape (1, 1, 128), and returns one
speech probability per window and the new state. Windows in one call run as a
sequence, so a chunk of several windows costs one ``run()``; this is how
``faster_whisper.vad.SileroVADModel`` drives it, minus the state reset per call.

A window costs ~0.15 ms on one core (measured), so sessions run it inline on the event
loop instead of paying a thread hop per 20 ms chunk.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from voicebot.errors import ModelError

WINDOW = 512  # samples at 16 kHz: 32 ms
CONTEXT = 64  # samples of the previous window the model sees
_STATE_SHAPE = (1, 1, 128)


def default_model_path() -> Path:
    import faster_whisper

    return Path(os.path.dirname(faster_whisper.__file__)) / "assets" / "silero_vad_v6.onnx"


class SileroVad:
    """The shared model. ``onnxruntime.InferenceSession.run`` is thread-safe."""

    def __init__(self, model_path: str | Path | None = None) -> None:
        import onnxruntime as ort

        path = Path(model_path) if model_path is not None else default_model_path()
        opts = ort.SessionOptions()
        # One thread: per-window work is tiny, and the cores belong to ASR/LLM/TTS.
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(
                str(path), sess_options=opts, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            raise ModelError(f"cannot load Silero VAD from {path}: {exc}") from exc
        names = {i.name for i in self._session.get_inputs()}
        if names != {"input", "h", "c"}:
            raise ModelError(f"{path}: not a Silero VAD v6 graph (inputs {sorted(names)})")

    def stream(self) -> VadStream:
        return VadStream(self)

    def _run(
        self, windows: np.ndarray, h: np.ndarray, c: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        probs, h, c = self._session.run(None, {"input": windows, "h": h, "c": c})
        return np.asarray(probs, dtype=np.float32).reshape(-1), h, c


class VadStream:
    """One session's VAD state: RNN state, 64-sample context, samples short of a window."""

    def __init__(self, model: SileroVad) -> None:
        self._model = model
        self.reset()

    def reset(self) -> None:
        self._h = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self._c = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._rest = np.zeros(0, dtype=np.float32)

    def process(self, audio16k: np.ndarray) -> np.ndarray:
        """Speech probabilities, one per complete 512-sample window (may be empty)."""
        audio = np.asarray(audio16k, dtype=np.float32).reshape(-1)
        if self._rest.size:
            audio = np.concatenate([self._rest, audio])
        n = audio.size // WINDOW
        self._rest = audio[n * WINDOW :].copy()
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        windows = audio[: n * WINDOW].reshape(n, WINDOW)
        # Each window's context is the tail of the window before it.
        contexts = np.concatenate([self._context[None, :], windows[:-1, -CONTEXT:]])
        batch = np.ascontiguousarray(np.concatenate([contexts, windows], axis=1))
        self._context = windows[-1, -CONTEXT:].copy()
        probs, self._h, self._c = self._model._run(batch, self._h, self._c)
        return probs
