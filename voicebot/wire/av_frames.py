"""WebRTC audio frames (PyAV ``AudioFrame``, as aiortc decodes and encodes them) <->
mono samples: what the server's media track and the probe's peer both need."""

from __future__ import annotations

import fractions

import av
import numpy as np


def frame_to_mono(frame: av.AudioFrame) -> np.ndarray:
    """A decoded frame (any layout, s16 or float, packed or planar) -> mono float32."""
    arr = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if frame.format.is_planar:
        mono = arr.reshape(channels, -1).mean(axis=0) if channels > 1 else arr.reshape(-1)
    else:
        mono = arr.reshape(-1, channels).mean(axis=1) if channels > 1 else arr.reshape(-1)
    if arr.dtype.kind == "i":  # s16 from Opus; s32 in principle
        return (mono / float(2 ** (8 * arr.dtype.itemsize - 1))).astype(np.float32)
    return mono.astype(np.float32, copy=False)


def pcm16_frame(samples: np.ndarray, rate: int, pts: int) -> av.AudioFrame:
    """int16 mono samples -> an aiortc-ready AudioFrame stamped on a 1/rate clock."""
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = rate
    frame.pts = pts
    frame.time_base = fractions.Fraction(1, rate)
    return frame
