"""Twilio Media Streams (and Telnyx) audio and marks: what both ends of the stream do.

Audio is base64 G.711 (μ-law, or A-law on Telnyx) at 8 kHz, one byte a sample, sent
in 20 ms frames of 160 bytes. A mark names a position in a reply; the carrier echoes
it once the audio before it has played.
"""

from __future__ import annotations

import numpy as np

from voicebot.audio import float_to_pcm16, pcm16_to_float
from voicebot.wire import g711

RATE = g711.RATE
FRAME = 160  # samples (= G.711 bytes) in 20 ms at 8 kHz


def decode_audio(fmt: g711.G711, payload: bytes) -> np.ndarray:
    """G.711 bytes -> float32 samples at 8 kHz."""
    return pcm16_to_float(g711.decode(fmt, payload))


def encode_audio(fmt: g711.G711, audio: np.ndarray) -> bytes:
    """float32 samples at 8 kHz -> G.711 bytes (clipped)."""
    return g711.encode(fmt, float_to_pcm16(audio))


class Framer:
    """Re-cuts 8 kHz audio into exact 160-sample frames; a partial tail waits for more."""

    def __init__(self, size: int = FRAME) -> None:
        self.size = size
        self._tail = np.zeros(0, dtype=np.float32)  # always shorter than one frame

    def push(self, audio: np.ndarray) -> list[np.ndarray]:
        buf = np.concatenate([self._tail, audio.astype(np.float32, copy=False)])
        whole = buf.size - buf.size % self.size
        self._tail = buf[whole:]
        return [buf[i : i + self.size] for i in range(0, whole, self.size)]

    def flush(self) -> list[np.ndarray]:
        """The tail padded with silence to a whole frame (end of a reply)."""
        if self._tail.size == 0:
            return []
        frame = np.zeros(self.size, dtype=np.float32)
        frame[: self._tail.size] = self._tail
        self._tail = np.zeros(0, dtype=np.float32)
        return [frame]

    def reset(self) -> None:
        self._tail = np.zeros(0, dtype=np.float32)


def mark_name(response_id: str, ms: int, end: bool = False) -> str:
    return f"{response_id}:{ms}" + (":end" if end else "")


def parse_mark(name: str) -> tuple[str, int, bool] | None:
    """(response id, ms of that reply played up to the mark, end of reply?) or None."""
    parts = name.split(":")
    if len(parts) not in (2, 3) or not (parts[1].isascii() and parts[1].isdigit()) or (len(parts) == 3 and parts[2] != "end"):
        return None
    return parts[0], int(parts[1]), len(parts) == 3
