"""Streaming Silero VAD (v6 ONNX, shipped inside the faster-whisper wheel).

``SileroVad`` holds the one onnxruntime session all sessions share; ``VadStream`` is one
session's state. The v6 graph takes ``input`` of shape (windows, 64 + 512) — each
512-sample window (32 ms at 16 kHz) preceded by the last 64 samples of the window
before it — plus LSTM state ``h`` and ``c`` of shape (1, 1, 128), and returns one
speech probability per window and the new state. Windows in one call run as a
sequence, so a chunk of several windows costs one ``run()``; this is how
``faster_whisper.vad.SileroVADModel`` drives it, minus the state reset per call.

A window costs less than a thread hop (docs/benchmarks.md, 'What the event loop pays'), so
sessions run it inline on the event loop instead of paying a hop per 20 ms chunk.

Long silence: after several seconds of silence (a caller listening to a reply) the
model's recurrent state drifts so that the next short word scores low: a real 0.75 s
telephone "them" after 5-19 s of silence stayed below 0.5, or above it for fewer than
``vad.min_speech_ms`` in a row, at 11 of 48 window alignments (tests/e2e/test_short_utterance.py),
and the word was never heard. The state is therefore reset after ``QUIET_RESET_WINDOWS``
windows of quiet (about a second), as if a fresh stream began; speech never triggers
it, and a reset in the middle of silence changes nothing that follows but the drift.
A state of zeros is cold, though: the first windows after it score speech low, so a
reset that fell in the few quiet windows just before a word lost the word again (5 of
500 silence lengths, tests/e2e/test_short_utterance.py). The fresh state is therefore
warmed on the last ``WARM_WINDOWS`` quiet windows, as a stream that had just heard
them would be.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from voicebot.errors import ModelError

WINDOW = 512  # samples at 16 kHz: 32 ms
CONTEXT = 64  # samples of the previous window the model sees
_STATE_SHAPE = (1, 1, 128)
QUIET_PROB = 0.15  # below this a window is quiet
QUIET_RESET_WINDOWS = 31  # ~1 s of quiet: start the recurrent state afresh
WARM_WINDOWS = 8  # replayed into the fresh state (none lost at 8 or 16; 5 of 500 at 0)


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
        self._reset_state()
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._rest = np.zeros(0, dtype=np.float32)
        self._recent = np.zeros((0, CONTEXT + WINDOW), dtype=np.float32)  # the last model inputs

    def _reset_state(self) -> None:
        self._h = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self._c = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self._quiet = 0  # consecutive quiet windows since the state was last fresh

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
        return self._run(batch)

    def _run(self, batch: np.ndarray) -> np.ndarray:
        """Run windows in order, restarting the state where a quiet stretch reaches
        QUIET_RESET_WINDOWS (the windows after it run again from the fresh state, so
        the result does not depend on how the audio was chunked)."""
        h, c = self._h, self._c
        probs, self._h, self._c = self._model._run(batch, h, c)
        quiet = self._quiet
        for i, p in enumerate(probs):
            quiet = quiet + 1 if p < QUIET_PROB else 0
            if quiet >= QUIET_RESET_WINDOWS:
                self._restart(batch[: i + 1])
                if i + 1 < len(probs):
                    probs = np.concatenate([probs[: i + 1], self._run(batch[i + 1 :])])
                return probs
        self._quiet = quiet
        self._keep(batch)
        return probs

    def _keep(self, rows: np.ndarray) -> None:
        self._recent = np.concatenate([self._recent, rows])[-WARM_WINDOWS:]

    def _restart(self, rows: np.ndarray) -> None:
        """A fresh state that has heard the last quiet windows (``rows`` end the stretch)."""
        self._keep(rows)
        self._reset_state()
        _, self._h, self._c = self._model._run(self._recent, self._h, self._c)
