"""espeak-ng (Debian package ``espeak-ng``, no weights) behind the TTS interface.

Each sentence is one ``espeak-ng --stdout`` process, started from a worker-pool
thread that waits for it; cancelling a running sentence kills the process.
Why a process rather than libespeak-ng through ctypes: the library synthesises a
sentence several times sooner than a process does, but it is one global, non-thread-safe instance per process (``workers`` > 1 would need a
global lock), can only be aborted between callbacks, and Piper loads its own copy of
espeak-ng into the same process. A process's first audio is still well inside the turn
budget; the process is killable, isolated and runs in parallel.
"""

from __future__ import annotations

import logging
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing
from functools import partial

import numpy as np

from voicebot.audio import resample
from voicebot.config import TtsConfig
from voicebot.engines.tts.pool import PooledTts, WorkerPool, stream_jobs
from voicebot.engines.tts.text import clean_text, resolve_speed, split_sentences
from voicebot.errors import EngineError, ModelError

log = logging.getLogger(__name__)

ESPEAK_RATE = 22_050  # espeak-ng's native output rate
DEFAULT_VOICE = "en-us"
DEFAULT_WPM = 175  # espeak-ng's default -s
# espeak-ng's -s range; above ~450 it speeds up with sonic and stays intelligible.
MIN_WPM, MAX_WPM = 80, 700


class _Process:
    """A running espeak-ng that another thread may kill (abort may come before Popen)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.killed = False

    def run(self, argv: list[str], text: str) -> tuple[int, bytes, bytes]:
        with self._lock:
            if self.killed:
                return -9, b"", b""
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        # communicate() also reaps the process after a kill: no zombies.
        out, err = self._proc.communicate(text.encode("utf-8"))
        return self._proc.returncode, out, err

    def kill(self) -> None:
        with self._lock:
            self.killed = True
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()


def parse_wav(data: bytes) -> tuple[np.ndarray, int]:
    """PCM16 mono WAV from a pipe (its size fields are placeholders) -> float32, rate."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise EngineError("espeak-ng did not write a WAV stream")
    pos, rate = 12, 0
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if chunk == b"fmt ":
            fmt, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", data, body)
            if (fmt, channels, bits) != (1, 1, 16):
                raise EngineError(f"espeak-ng WAV format {fmt}/{channels}ch/{bits}bit unsupported")
        elif chunk == b"data":
            pcm = data[body : body + (len(data) - body) // 2 * 2]  # size field is bogus: take all
            return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0, rate
        pos = body + size + (size & 1)
    raise EngineError("espeak-ng WAV stream has no data chunk")


def _synth_sentence(argv: list[str], text: str, proc: _Process, rate: int) -> np.ndarray:
    """One sentence's audio; runs in a worker thread."""
    t0 = time.perf_counter()
    code, out, err = proc.run(argv, text)
    if proc.killed:
        return np.zeros(0, dtype=np.float32)  # cancelled: nobody wants this result
    if code != 0:
        raise EngineError(f"espeak-ng exited with {code}: {err.decode(errors='replace').strip()}")
    audio, got = parse_wav(out)
    if got != rate:
        audio = resample(audio, got, rate)
    log.debug("espeak: %.2f s of audio in %.3f s", audio.size / rate, time.perf_counter() - t0)
    return audio


class EspeakTts(PooledTts):
    """espeak-ng voices by language name ("en-us", "en-gb", "de" ...; "+f3"-style variants allowed)."""

    sample_rate: int = ESPEAK_RATE

    def __init__(self, cfg: TtsConfig) -> None:
        self._cfg = cfg
        # tts.voice defaults to the Piper bundle; that means "the default voice" here.
        looks_like_piper = cfg.voice.startswith("bundle:") or "/" in cfg.voice
        self._default_voice = DEFAULT_VOICE if looks_like_piper else cfg.voice
        self._pool = WorkerPool(cfg.workers, cfg.queue_size, "tts-espeak")
        self._binary: str | None = None
        self._voices: list[str] = []

    async def start(self) -> None:
        binary = shutil.which("espeak-ng")
        if binary is None:
            raise ModelError("espeak-ng not found on PATH: install the Debian package 'espeak-ng'")
        self._binary = binary
        self._pool.start()
        listing = await self._pool.submit(
            partial(subprocess.run, [binary, "--voices"], capture_output=True, check=True)
        ).future
        # Columns: Pty Language Age/Gender VoiceName File Other-languages.
        lines = listing.stdout.decode(errors="replace").splitlines()[1:]
        self._voices = sorted({line.split()[1] for line in lines if len(line.split()) > 1})
        if self._default_voice.split("+", 1)[0] not in self._voices:
            raise ModelError(f"tts.voice={self._default_voice!r} is not an espeak-ng voice")
        log.info("espeak-ng ready: %d voices, default %s", len(self._voices), self._default_voice)

    def voices(self) -> list[str]:
        return list(self._voices)

    def _check_voice(self, voice: str) -> None:
        if voice.split("+", 1)[0] not in self._voices:
            raise EngineError(f"unknown espeak-ng voice {voice!r} (see 'espeak-ng --voices')")

    async def synthesize(
        self, text: str, *, voice: str | None = None, speed: float | None = None, ahead_s: float = 0.0
    ) -> AsyncGenerator[np.ndarray, None]:
        sentences = split_sentences(clean_text(text))
        if not sentences:
            return
        if self._binary is None:
            raise EngineError("espeak-ng engine is not started")
        name = voice or self._default_voice
        self._check_voice(name)
        wpm = round(DEFAULT_WPM * resolve_speed(speed, self._cfg.speed))
        # Text goes through stdin: never parsed as an option, no argv length limit.
        argv = [
            self._binary,
            "--stdout",
            "-b",
            "1",
            "-v",
            name,
            "-s",
            str(min(max(wpm, MIN_WPM), MAX_WPM)),
        ]

        def jobs() -> Iterator[tuple[Callable[[], np.ndarray], Callable[[], None]]]:
            for sentence in sentences:
                proc = _Process()
                yield partial(_synth_sentence, argv, sentence, proc, self.sample_rate), proc.kill

        # aclosing: closing this generator must close the inner one now, not at GC.
        async with aclosing(stream_jobs(self._pool, jobs())) as chunks:
            async for chunk in chunks:
                yield chunk
