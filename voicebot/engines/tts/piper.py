"""Piper (VITS, ONNX) behind the TTS interface.

One ONNX session per loaded voice, shared by every worker thread (onnxruntime's
``run`` is thread-safe; Piper serialises its espeak-ng phonemizer with its own lock).
A running sentence cannot be interrupted inside onnxruntime: on cancellation its
result is discarded and its thread is free again within one sentence's synthesis time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial
from pathlib import Path

import numpy as np
from piper import PiperVoice, SynthesisConfig

from voicebot.audio import resample
from voicebot.config import TtsConfig
from voicebot.engines.tts.pool import PooledTts, WorkerPool, stream_jobs
from voicebot.engines.tts.text import clean_text, resolve_speed, split_sentences
from voicebot.errors import EngineError, ModelError

log = logging.getLogger(__name__)

# Extra voices kept loaded besides the default one (each holds its model's memory, and
# loading one again takes about a second).
VOICE_CACHE_SIZE = 3


def find_voice_files(path: str | Path) -> tuple[Path, Path]:
    """``(model.onnx, model.onnx.json)`` for a voice directory or an ``.onnx`` file."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".onnx":
        model = p
    elif p.is_dir():
        models = sorted(p.glob("*.onnx"))
        if len(models) != 1:
            raise ModelError(
                f"Piper voice directory {p} must hold exactly one .onnx file, found {len(models)}"
            )
        model = models[0]
    else:
        raise ModelError(
            f"Piper voice not found: {p} (expected a directory with <voice>.onnx and <voice>.onnx.json)"
        )
    config = model.with_name(model.name + ".json")
    if not config.is_file():
        raise ModelError(f"Piper voice config missing: {config}")
    return model, config


def _load_voice(model: Path, config: Path, threads: int = 0) -> PiperVoice:
    """``threads``: onnxruntime intra-op threads per synthesis (0: its default, every
    core). ``PiperVoice.load`` takes no session options, so the session is built here."""
    t0 = time.perf_counter()
    try:
        if threads:
            import onnxruntime
            from piper.config import PiperConfig
            from piper.phonemize_espeak import ESPEAK_DATA_DIR

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            session = onnxruntime.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])
            voice = PiperVoice(
                config=PiperConfig.from_dict(json.loads(config.read_text(encoding="utf-8"))),
                session=session,
                espeak_data_dir=Path(ESPEAK_DATA_DIR),
                download_dir=Path.cwd(),
            )
        else:
            voice = PiperVoice.load(model, config)
    except Exception as exc:
        raise ModelError(f"cannot load Piper voice {model}: {exc}") from exc
    log.info("loaded Piper voice %s in %.2f s", model.stem, time.perf_counter() - t0)
    return voice


class PiperTts(PooledTts):
    """Piper voices; the default one from ``voice_path``, others loaded on first use."""

    def __init__(self, cfg: TtsConfig, voice_path: str) -> None:
        self._cfg = cfg
        self._default_files = find_voice_files(voice_path)
        self._default_key = str(self._default_files[0].resolve())
        # Known before start() so the session can set up its resampler early.
        self.sample_rate: int = int(
            json.loads(self._default_files[1].read_text())["audio"]["sample_rate"]
        )
        self._pool = WorkerPool(cfg.workers, cfg.queue_size, "tts-piper")
        self._default: PiperVoice | None = None
        self._extra: OrderedDict[str, PiperVoice] = OrderedDict()  # LRU, key: resolved model path
        self._load_lock = asyncio.Lock()

    async def start(self) -> None:
        self._default = await asyncio.to_thread(_load_voice, *self._default_files, self._cfg.intra_op_threads)
        self._pool.start()

    def voices(self) -> list[str]:
        """Loaded voices by name (default first); a voice directory is accepted too."""
        return [self._default_files[0].stem, *(Path(k).stem for k in self._extra)]

    async def _voice(self, name: str | None) -> PiperVoice:
        if self._default is None:
            raise EngineError("Piper engine is not started")
        if name is None or name == self._default_files[0].stem:
            return self._default
        for key, voice in self._extra.items():
            if Path(key).stem == name:
                self._extra.move_to_end(key)
                return voice
        # A bad per-call voice is the caller's error, not a reason to end the session
        # (ModelError is fatal): report it as a non-fatal EngineError.
        try:
            model, config = find_voice_files(name)
        except ModelError as exc:
            raise EngineError(f"unknown Piper voice {name!r}: {exc}") from None
        key = str(model.resolve())
        if key == self._default_key:
            return self._default
        # One load at a time, so two sessions asking for the same new voice load it once.
        async with self._load_lock:
            if key not in self._extra:
                # Loaded outside the worker pool: a load of about a second must not stall every
                # session's sentences queued behind it.
                try:
                    voice = await asyncio.to_thread(_load_voice, model, config, self._cfg.intra_op_threads)
                except ModelError as exc:
                    raise EngineError(str(exc)) from None
                self._extra[key] = voice
                while len(self._extra) > VOICE_CACHE_SIZE:
                    self._extra.popitem(last=False)
            self._extra.move_to_end(key)
            return self._extra[key]

    async def synthesize(
        self, text: str, *, voice: str | None = None, speed: float | None = None, ahead_s: float = 0.0
    ) -> AsyncGenerator[np.ndarray, None]:
        sentences = split_sentences(clean_text(text))
        if not sentences:
            return
        pv = await self._voice(voice)
        syn = SynthesisConfig(
            length_scale=pv.config.length_scale / resolve_speed(speed, self._cfg.speed),
            noise_scale=self._cfg.piper_noise_scale,  # None: the voice's own
            noise_w_scale=self._cfg.piper_noise_w,
        )
        jobs = ((partial(_synth_sentence, pv, s, syn, self.sample_rate), None) for s in sentences)
        # aclosing: closing this generator must close the inner one now, not at GC.
        async with aclosing(stream_jobs(self._pool, jobs)) as chunks:
            async for chunk in chunks:
                yield chunk


def _synth_sentence(voice: PiperVoice, text: str, syn: SynthesisConfig, rate: int) -> np.ndarray:
    """One sentence's audio; runs in a worker thread."""
    t0 = time.perf_counter()
    try:
        parts = [c.audio_float_array for c in voice.synthesize(text, syn)]
    except Exception as exc:
        raise EngineError(f"Piper failed on {text[:40]!r}: {exc}") from exc
    audio = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    if voice.config.sample_rate != rate:  # a voice other than the default, at another rate
        audio = resample(audio, voice.config.sample_rate, rate)
    log.debug("piper: %.2f s of audio in %.3f s", audio.size / rate, time.perf_counter() - t0)
    return audio.astype(np.float32, copy=False)
