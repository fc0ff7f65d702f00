"""G.711 μ-law / A-law <-> PCM16 (8 kHz telephony audio, one byte per sample).

``audioop`` does this in C; it left the standard library in Python 3.13, where the
``audioop-lts`` package provides the same module. Its PCM16 is in native byte order,
little-endian on every platform we run on (asserted below, since the wire is LE).
"""

from __future__ import annotations

import sys
import warnings
from typing import Literal

with warnings.catch_warnings():
    # 3.11/3.12 warn that audioop is deprecated; audioop-lts is the way forward.
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

assert sys.byteorder == "little", "PCM16 on the wire is little-endian"

G711 = Literal["audio/pcmu", "audio/pcma"]
RATE = 8000


def decode(fmt: G711, data: bytes) -> bytes:
    """G.711 bytes -> PCM16 little-endian bytes (twice as long)."""
    if fmt == "audio/pcmu":
        return audioop.ulaw2lin(data, 2)
    return audioop.alaw2lin(data, 2)


def encode(fmt: G711, pcm16: bytes) -> bytes:
    """PCM16 little-endian bytes (even length) -> G.711 bytes (half as long)."""
    if fmt == "audio/pcmu":
        return audioop.lin2ulaw(pcm16, 2)
    return audioop.lin2alaw(pcm16, 2)
