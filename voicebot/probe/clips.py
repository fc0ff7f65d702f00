"""User turns: WAV files of any rate, resampled to the rate the session declares and
cut into the 20 ms PCM16 frames a real-time caller sends."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from voicebot.audio import float_to_pcm16, read_wav
from voicebot.errors import ConfigError
from voicebot.probe.measure import THRESHOLD_DBFS, speech_span

MAX_CLIP_S = 120.0  # a turn is a sentence or two; this bounds memory per clip


@dataclass(frozen=True)
class Clip:
    path: str
    rate: int
    frames: tuple[bytes, ...]  # PCM16 mono, the last one zero-padded
    first_speech_frame: int  # frame holding the first sample above the threshold
    last_speech_frame: int  # frame holding the last one: its send time is "end of speech"

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def duration_s(self) -> float:
        return len(self.frames) * (len(self.frames[0]) // 2) / self.rate


def load_clip(
    path: str, rate: int, frame_ms: int = 20, threshold_dbfs: float = THRESHOLD_DBFS
) -> Clip:
    """Read, downmix and resample ``path``; locate its speech with the dBFS detector."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"audio file not found: {path}")
    try:
        audio, _ = read_wav(p, rate)
    except Exception as exc:  # soundfile raises its own LibsndfileError and friends
        raise ConfigError(f"cannot read audio file {path}: {exc}") from None
    if audio.size > MAX_CLIP_S * rate:
        raise ConfigError(
            f"{path} is longer than {MAX_CLIP_S:.0f} s; use a single turn's worth of speech"
        )
    span = speech_span(audio, rate, threshold_dbfs)
    if span is None:
        raise ConfigError(f"{path} has no audio above {threshold_dbfs} dBFS")
    n = rate * frame_ms // 1000
    count = max(1, -(-audio.size // n))
    padded = np.zeros(count * n, dtype=np.float32)
    padded[: audio.size] = audio
    pcm = float_to_pcm16(padded)
    frames = tuple(pcm[i * 2 * n : (i + 1) * 2 * n] for i in range(count))
    return Clip(
        path=str(path),
        rate=rate,
        frames=frames,
        first_speech_frame=span[0] // n,
        last_speech_frame=(span[1] - 1) // n,
    )
