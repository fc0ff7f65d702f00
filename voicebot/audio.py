"""PCM helpers shared by transports and engines.

Inside the pipeline audio is ``numpy.float32`` mono in [-1, 1] (engines) or PCM16
``bytes`` (wires). Sample-rate conversion happens once at each edge, with a
stateful soxr stream so chunk borders carry no clicks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

ASR_RATE = 16_000


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian PCM16 bytes -> float32 in [-1, 1)."""
    if len(data) % 2:
        raise ValueError("PCM16 audio must have an even number of bytes")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(audio: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> little-endian PCM16 bytes (clipped)."""
    clipped = np.clip(audio, -1.0, 32767.0 / 32768.0)
    return (clipped * 32768.0).astype("<i2").tobytes()


def dbfs(audio: np.ndarray) -> float:
    """RMS level in dBFS (-inf for digital silence)."""
    if audio.size == 0:
        return float("-inf")
    rms = float(np.sqrt(np.mean(np.square(audio, dtype=np.float64))))
    return 20.0 * np.log10(rms) if rms > 0 else float("-inf")


class Resampler:
    """Streaming sample-rate converter that keeps filter state across chunks."""

    def __init__(self, in_rate: int, out_rate: int, quality: str = "HQ") -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None
            if in_rate == out_rate
            else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=quality)
        )

    def process(self, audio: np.ndarray, last: bool = False) -> np.ndarray:
        if self._stream is None:
            return audio.astype(np.float32, copy=False)
        return self._stream.resample_chunk(audio.astype(np.float32, copy=False), last=last)

    def flush(self) -> np.ndarray:
        return self.process(np.zeros(0, dtype=np.float32), last=True)


class ReplyResampler:
    """Reply audio to a transport's wire rate: the one convention every transport follows.

    A transport asks its call for reply audio at the wire rate
    (``SessionSettings.output_sample_rate``), so the call resamples each synthesised
    sentence once, whole, and this is a pass-through. It converts only audio that comes
    at another rate (the Realtime wire's output format can change during a call): one
    stateful stream per reply, so chunk borders carry no clicks, started afresh by a
    new reply and emptied by :meth:`flush` at the reply's end.
    """

    def __init__(self, out_rate: int) -> None:
        self.out_rate = out_rate
        self.response_id: str | None = None  # the reply being converted
        self._stream: Resampler | None = None

    def process(self, response_id: str, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        if response_id != self.response_id or self._stream is None or self._stream.in_rate != sample_rate:
            self.response_id, self._stream = response_id, Resampler(sample_rate, self.out_rate)
        return self._stream.process(audio)

    def flush(self) -> np.ndarray:
        """The current reply's tail (empty if none); the next audio starts a new stream."""
        stream, self.response_id, self._stream = self._stream, None, None
        return stream.flush() if stream is not None else np.zeros(0, dtype=np.float32)

    def reset(self) -> None:
        """Drop the current reply (cut): its tail is never sent."""
        self.response_id, self._stream = None, None


def resample(audio: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    """One-shot resampling of a whole signal."""
    if in_rate == out_rate:
        return audio.astype(np.float32, copy=False)
    return soxr.resample(audio.astype(np.float32, copy=False), in_rate, out_rate, quality="HQ")


def read_wav(path: str | Path, rate: int | None = None) -> tuple[np.ndarray, int]:
    """Read any soundfile-readable file as mono float32, optionally resampled."""
    data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    mono = data.mean(axis=1)
    if rate is not None and sr != rate:
        return resample(mono, sr, rate), rate
    return mono, sr
