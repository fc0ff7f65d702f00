"""Real speech for tests: six short English recordings with reference transcripts.

They come from the pocketsphinx 5.1.1 source archive on PyPI (pinned by sha256): five
LibriVox clips of "Sense and Sensibility" (public domain) and CMU's "go forward ten
meters". The archive is fetched once into ``<cache_dir>/downloads``; the clips are
extracted to ``<cache_dir>/testdata/speech/`` as 16 kHz mono WAV files.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from voicebot.audio import ASR_RATE, pcm16_to_float, read_wav
from voicebot.config import ModelsConfig
from voicebot.provision import fetch_sdist

SDIST = ("pocketsphinx", "5.1.1", "675778b309a22dfc9b7d37f7621976bba491d2a5f8c59696bd77fd6d07271355")
_DATA = "pocketsphinx-5.1.1/test/data/"
LIBRIVOX = [f"sense_and_sensibility_01_austen_64kb-{n:04d}" for n in (870, 880, 890, 920, 930)]
GOFORWARD = ("goforward", "go forward ten meters")


@dataclass(frozen=True)
class Clip:
    name: str
    path: Path
    text: str
    audio: np.ndarray  # float32 mono, 16 kHz

    @property
    def duration_s(self) -> float:
        return len(self.audio) / ASR_RATE


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    f = tar.extractfile(_DATA + name)
    if f is None:
        raise FileNotFoundError(f"{name} is not a regular file in the pocketsphinx sdist")
    return f.read()


def _extract(dest: Path, models: ModelsConfig) -> None:
    archive = fetch_sdist(*SDIST, models)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    with tarfile.open(archive) as tar:
        for stem in LIBRIVOX:
            (tmp / f"{stem}.wav").write_bytes(_member(tar, f"librivox/{stem}.wav"))
            (tmp / f"{stem}.txt").write_text(_member(tar, f"librivox/{stem}.txt").decode().strip() + "\n")
        # goforward.raw is headerless 16 kHz s16le; a WAV header makes it self-describing.
        raw = pcm16_to_float(_member(tar, "goforward.raw"))
        sf.write(tmp / f"{GOFORWARD[0]}.wav", raw, ASR_RATE, subtype="PCM_16")
        (tmp / f"{GOFORWARD[0]}.txt").write_text(GOFORWARD[1] + "\n")
    # Published by rename so a half-extracted folder is never mistaken for a complete one;
    # when another test process won the race, its copy is as good as ours.
    try:
        tmp.rename(dest)
    except OSError:
        if not dest.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def load_clips(models: ModelsConfig) -> list[Clip]:
    """The six clips, extracted on first use; raises if any is missing or unreadable."""
    dest = Path(models.cache_dir).expanduser() / "testdata" / "speech"
    if not dest.is_dir():
        _extract(dest, models)
    clips = []
    for stem in [*LIBRIVOX, GOFORWARD[0]]:
        path = dest / f"{stem}.wav"
        audio, rate = read_wav(path, ASR_RATE)
        text = (dest / f"{stem}.txt").read_text().strip()
        if rate != ASR_RATE or audio.size < ASR_RATE // 2 or not text:
            raise ValueError(f"{path}: unusable test clip ({audio.size} samples at {rate} Hz)")
        clips.append(Clip(stem, path, text, audio.astype(np.float32, copy=False)))
    return clips
