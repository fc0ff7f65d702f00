"""Pure measurement helpers: levels per 10 ms block, speech onset/end, percentiles.

Everything here is synchronous and I/O free so the tests can pin the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

THRESHOLD_DBFS = -40.0
BLOCK_MS = 10


def block_levels(audio: np.ndarray, rate: int, block_ms: int = BLOCK_MS) -> np.ndarray:
    """RMS level in dBFS of each complete ``block_ms`` block (-inf for digital silence).

    A trailing partial block is ignored: under 10 ms it cannot decide an onset.
    """
    n = max(1, rate * block_ms // 1000)
    full = audio.size // n
    if full == 0:
        return np.zeros(0, dtype=np.float64)
    blocks = audio[: full * n].reshape(full, n).astype(np.float64)
    rms = np.sqrt(np.mean(np.square(blocks), axis=1))
    with np.errstate(divide="ignore"):
        levels: np.ndarray = 20.0 * np.log10(rms)
    return levels


def speech_span(
    audio: np.ndarray, rate: int, threshold_dbfs: float = THRESHOLD_DBFS, block_ms: int = BLOCK_MS
) -> tuple[int, int] | None:
    """(first, end) sample of the audible part: the first block above the threshold
    to the end of the last one; None when nothing is audible."""
    levels = block_levels(audio, rate, block_ms)
    loud = np.flatnonzero(levels > threshold_dbfs)
    if loud.size == 0:
        return None
    n = max(1, rate * block_ms // 1000)
    return int(loud[0]) * n, (int(loud[-1]) + 1) * n


class OnsetDetector:
    """Streaming form of the block detector for received audio.

    Chunks arrive at arbitrary sizes; a 10 ms block that straddles two chunks is
    judged when its last sample arrives, so the onset is attributed to that chunk.
    """

    def __init__(
        self, rate: int, threshold_dbfs: float = THRESHOLD_DBFS, block_ms: int = BLOCK_MS
    ) -> None:
        self.rate = rate
        self.threshold_dbfs = threshold_dbfs
        self.block_ms = block_ms
        self._block = max(1, rate * block_ms // 1000)
        self._rest = np.zeros(0, dtype=np.float32)
        self._rest16 = np.zeros(0, dtype="<i2")
        # Block energy (sum of squares, PCM16 units) of a block exactly at the threshold.
        self._energy = self._block * (32768.0 * 10 ** (threshold_dbfs / 20)) ** 2

    def reset(self) -> None:
        self._rest = np.zeros(0, dtype=np.float32)
        self._rest16 = np.zeros(0, dtype="<i2")

    def feed_pcm16(self, pcm: bytes) -> bool:
        """:meth:`feed` for PCM16 as it comes off the wire, without a float copy.

        The probe runs this for reply chunks of every session: one sum of squares per
        block against the threshold's energy (no square root, no logarithm).
        """
        return self._loud_blocks16(pcm) > 0

    def loud_ms(self, pcm: bytes) -> float:
        """Audio above the threshold in the blocks this PCM16 chunk completes, in ms."""
        return self._loud_blocks16(pcm) * self.block_ms

    def _loud_blocks16(self, pcm: bytes) -> int:
        x = np.frombuffer(pcm, dtype="<i2")
        if self._rest16.size:
            x = np.concatenate([self._rest16, x])
        full = x.size // self._block * self._block
        self._rest16 = x[full:].copy()  # under one block: bounded
        if full == 0:
            return 0
        blocks = x[:full].astype(np.float64).reshape(-1, self._block)
        return int(np.count_nonzero(np.einsum("ij,ij->i", blocks, blocks) > self._energy))

    def feed(self, audio: np.ndarray) -> bool:
        """True when a block completed by this chunk is above the threshold."""
        buf = np.concatenate([self._rest, audio.astype(np.float32, copy=False)])
        full = buf.size // self._block * self._block
        self._rest = buf[full:].copy()  # under one block: bounded
        levels = block_levels(buf[:full], self.rate, self.block_ms)
        return bool(np.any(levels > self.threshold_dbfs))


def percentiles(values: Iterable[float]) -> dict[str, float | int | None]:
    """p50/p90/p95/p99 plus n, mean, min, max (None when there are no values)."""
    data = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if data.size == 0:
        return {
            "n": 0,
            "p50": None,
            "p90": None,
            "p95": None,
            "p99": None,
            "mean": None,
            "min": None,
            "max": None,
        }
    p50, p90, p95, p99 = np.percentile(data, [50, 90, 95, 99])
    return {
        "n": int(data.size),
        "p50": round(float(p50), 1),
        "p90": round(float(p90), 1),
        "p95": round(float(p95), 1),
        "p99": round(float(p99), 1),
        "mean": round(float(data.mean()), 1),
        "min": round(float(data.min()), 1),
        "max": round(float(data.max()), 1),
    }
