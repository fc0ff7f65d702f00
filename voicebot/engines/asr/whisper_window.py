"""Whisper's encoder on the utterance, not on 30 s of padding.

faster-whisper pads every window's log-mel features to 3000 frames (30 s) before the
encoder, so a 1.5 s question costs the encoder as much as 30 s of speech. CTranslate2's
Whisper encoder takes any number of frames up to 3000 (it checks ``frames <= 3000`` since
CTranslate2 3.19, "Relax shape checks for Whisper input features", and slices its position
table to the length). :class:`WindowedWhisper` cuts the padded features down to the
utterance plus ``pad_s`` seconds of the same zero padding just before the encoder; the
decoder then attends over that shorter output. Everything else (prompt, prefix,
suppression, no-speech check) is faster-whisper's own ``transcribe``.

A decode can be stopped between its stages: ``transcribe_text(checkpoint=...)`` calls the
checkpoint just before the encoder and again between the encoder and the decoder, and
whatever it raises ends the decode there. Those are the only places: CTranslate2's
``Whisper.encode`` and ``Whisper.generate`` are single blocking calls with no callback.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from faster_whisper import WhisperModel

from voicebot.audio import ASR_RATE
from voicebot.engines.asr.loop_guard import token_budget

# The window arithmetic both Whisper paths share (that module needs neither engine).
from voicebot.engines.asr.whisper_vllm_window import FULL_FRAMES, needed_frames

__all__ = ["FULL_FRAMES", "WindowedWhisper", "window_frames"]

_STEP = 50  # windows are rounded up to 0.5 s: fewer distinct shapes
# <|startoftranscript|>, the language, the task (the last two: multilingual models only),
# <|notimestamps|>
_TASK_TOKENS = 4


def window_frames(samples: int, pad_s: float | None, min_s: float = 0.0) -> int:
    """Encoder frames for ``samples`` of 16 kHz audio plus ``pad_s`` seconds of padding,
    at least ``min_s`` seconds, rounded up to 0.5 s; never more than the full window.
    ``pad_s=None``: the full window."""
    if pad_s is None:
        return FULL_FRAMES
    frames = needed_frames(samples, pad_s, min_s)
    return min(FULL_FRAMES, max(_STEP, math.ceil(frames / _STEP) * _STEP))


class WindowedWhisper(WhisperModel):  # type: ignore[misc]  # faster-whisper has no type hints
    """A ``WhisperModel`` whose :meth:`transcribe_text` encodes a window sized to the audio."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._window = threading.local()  # frames for the decode running in this thread

    def transcribe_text(
        self,
        audio: np.ndarray,
        *,
        pad_s: float | None,
        min_s: float = 0.0,
        checkpoint: Callable[[], None] | None = None,
        tokens_per_s: float | None = None,
        **options: Any,
    ) -> str:
        """The whole transcript of ``audio`` (``transcribe``'s options), its encoder run on
        ``window_frames(audio.size, pad_s, min_s)`` frames. ``checkpoint`` is called before
        the encoder and before the decoder; an exception from it stops the decode.
        ``tokens_per_s``: at most that many new tokens per second of audio
        (:func:`~.loop_guard.token_budget`), net of the forced prefix's."""
        if tokens_per_s is not None:
            prompt = self.prompt_tokens(options.get("prefix") or "")
            options["max_new_tokens"] = token_budget(audio.size / ASR_RATE, prompt, tokens_per_s)
        self._window.frames = window_frames(audio.size, pad_s, min_s)
        self._window.checkpoint = checkpoint
        try:
            segments, _info = self.transcribe(audio, **options)
            return "".join(s.text for s in segments)  # the segments are decoded lazily, here
        finally:
            self._window.frames = None
            self._window.checkpoint = None

    def prompt_tokens(self, prefix: str) -> int:
        """Decoder prompt tokens ``transcribe`` puts before the text for a forced ``prefix``:
        at most 4 task tokens, then the prefix's own (which it cuts to half the window)."""
        prefix = prefix.strip()
        if not prefix:
            return _TASK_TOKENS
        ids = self.hf_tokenizer.encode(" " + prefix, add_special_tokens=False).ids
        return _TASK_TOKENS + min(len(ids), self.max_length // 2 - 1)

    def encode(self, features: np.ndarray) -> Any:
        frames = getattr(self._window, "frames", None)
        checkpoint = getattr(self._window, "checkpoint", None)
        if frames is not None and features.shape[-1] > frames:
            features = np.ascontiguousarray(features[..., :frames])
        if checkpoint is not None:
            checkpoint()
        out = super().encode(features)
        if checkpoint is not None:
            checkpoint()  # faster-whisper's generate_segments runs the decoder next
        return out
