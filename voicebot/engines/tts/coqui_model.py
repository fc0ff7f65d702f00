"""Coqui TTS models (the ``coqui-tts`` package, import name ``TTS``) behind the few calls the
engine (:mod:`voicebot.engines.tts.coqui`) makes: load a model, resolve a voice, and
synthesise a sentence as an iterator of float32 chunks.

Two families, the ones that produce a waveform themselves (no separate vocoder):

- VITS and the models built on it (YourTTS, multi-speaker VCTK voices ...): one forward per
  sentence, so one chunk per sentence. ``speed`` is the model's ``length_scale``, an
  attribute its forward reads; each speed gets its own shallow copy of the module (the
  weights are shared), so calls at different speeds on different threads never race.
- XTTS (v2): its own streaming inference, a chunk every ``stream_tokens`` GPT tokens, each
  decoded as soon as those tokens exist. The voice is a named speaker of the model or a
  reference clip, whose conditioning latents are computed once and kept.

A reference clip is read with soundfile and resampled here (torchaudio's loader needs
FFmpeg's libraries; nothing else of the model does). Everything here blocks: the engine
calls it from its worker threads.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from voicebot.audio import resample
from voicebot.errors import EngineError, ModelError

log = logging.getLogger(__name__)

# Checkpoint names Coqui's releases and its trainer use, in the order Coqui looks for them.
CHECKPOINT_NAMES = ("model_file.pth", "model_file.pth.tar", "model.pth", "best_model.pth", "checkpoint.pth")
# Files a model's config names by the absolute paths of the machine that trained it: point
# them at the copy in the model's directory (what Coqui's ModelManager does after a
# download), in memory only.
LOCAL_FILES = {
    "d_vector_file": ("speakers.json", "speakers.pth"),
    "speakers_file": ("speaker_ids.json", "speaker_ids.pth"),
    "language_ids_file": ("language_ids.json",),
    "speaker_encoder_model_path": ("model_se.pth", "model_se.pth.tar"),
    "speaker_encoder_config_path": ("config_se.json",),
}
CLIP_SUFFIXES = (".wav", ".flac", ".ogg")
# Reference clips whose conditioning is kept (each costs a forward of the clip to compute).
CLIP_CACHE_SIZE = 4
# Speeds whose VITS view is kept: a session may set any speed, the views share the weights.
SPEED_VIEWS = 8


def model_directory(ref: str) -> Path:
    """The local directory of a model reference (blocking: a name or repo id downloads).

    A directory is itself; ``tts_models/...`` is a Coqui model name (Coqui's ModelManager
    fetches it); anything else a Hugging Face repo id.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if ref.startswith(("/", "./", "../", "~")):
        raise ModelError(f"Coqui model directory {ref!r} does not exist")
    if path.exists():
        raise ModelError(f"Coqui model {ref!r} is a file: tts.coqui_model wants its directory (config.json beside the checkpoint)")
    try:
        if ref.startswith("tts_models/"):
            from TTS.utils.manage import ModelManager

            _, config_path, _ = ModelManager(progress_bar=False).download_model(ref)
            if config_path is None:
                raise ModelError(f"Coqui model {ref!r} has no config.json")
            return Path(config_path).parent
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref))
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 (network, hub and Coqui errors share no base)
        raise ModelError(f"cannot fetch Coqui model {ref!r}: {exc}") from exc


def find_checkpoint(directory: Path) -> Path:
    for name in CHECKPOINT_NAMES:
        if (directory / name).is_file():
            return directory / name
    found = [p for p in sorted(directory.glob("*.pth")) if p.name not in {n for names in LOCAL_FILES.values() for n in names}]
    if len(found) != 1:
        raise ModelError(f"Coqui model directory {directory} needs one checkpoint (model.pth or a single .pth), found {len(found)}")
    return found[0]


def _point_at_local_files(config: Any, directory: Path) -> None:
    sections = [config] + ([config.model_args] if config.get("model_args") else [])
    for key, defaults in LOCAL_FILES.items():
        named = []
        for section in sections:
            value = section.get(key) if key in section else None
            if isinstance(value, list):
                value = value[0] if value else None
            if value:
                named.append(Path(str(value)).name)
        local = next((directory / n for n in (*named, *defaults) if (directory / n).is_file()), None)
        if local is None:
            continue
        for section in sections:
            if key in section:
                section[key] = [str(local)] if isinstance(section[key], list) else str(local)


@dataclass(frozen=True)
class Voice:
    """A resolved voice: what the model is conditioned on (``None`` fields: the model's default)."""

    name: str
    speaker: str | None = None  # a speaker name of the model
    clip: Path | None = None  # VITS-family cloning models: a reference clip, embedded by the model
    latents: tuple[Any, Any] | None = None  # XTTS: (GPT conditioning latents, speaker embedding)


class CoquiModel:
    """One loaded Coqui model; thread-safe for concurrent syntheses."""

    def __init__(self, model: Any, config: Any, *, language: str, stream_tokens: int, source: str) -> None:
        from TTS.tts.models.xtts import Xtts

        self.model = model
        self.config = config
        self.source = source
        self.is_xtts = isinstance(model, Xtts)
        audio = config.audio
        self.sample_rate = int(audio.get("output_sample_rate") or audio["sample_rate"])
        self.language = language
        self.stream_tokens = stream_tokens
        self._views: OrderedDict[float, Any] = OrderedDict()
        self._clips: OrderedDict[Path, Voice] = OrderedDict()
        self._lock = threading.Lock()  # the two caches

    # --- voices ----------------------------------------------------------------------

    def speakers(self) -> list[str]:
        manager = getattr(self.model, "speaker_manager", None)
        if manager is None:
            return []
        if self.is_xtts:
            return list(getattr(manager, "speakers", None) or {})
        names = list(manager.speaker_names or [])
        return names if len(names) > 1 else []  # a single-speaker model has no choice

    def voice(self, name: str | None) -> Voice:
        """A speaker name, a reference clip path, or None (the model's default voice)."""
        speakers = self.speakers()
        if name is None:
            if not speakers:
                if self.is_xtts:
                    raise ModelError("this XTTS model has no named speakers: set tts.coqui_speaker to a reference clip (.wav)")
                return Voice("default")
            name = speakers[0]
        if name in speakers:
            if self.is_xtts:
                latent, embedding = self.model.speaker_manager.speakers[name].values()
                return Voice(name, speaker=name, latents=(latent, embedding))
            return Voice(name, speaker=name)
        clip = Path(name).expanduser()
        if clip.suffix.lower() in CLIP_SUFFIXES and clip.is_file():
            return self._clip_voice(clip.resolve())
        if not speakers:
            raise EngineError(f"unknown Coqui voice {name!r}: this model has one voice")
        raise EngineError(f"unknown Coqui voice {name!r} (speakers: {', '.join(speakers[:20])})")

    def _clip_voice(self, clip: Path) -> Voice:
        with self._lock:
            if clip in self._clips:
                self._clips.move_to_end(clip)
                return self._clips[clip]
        if self.is_xtts:
            voice = Voice(clip.stem, clip=clip, latents=self._xtts_latents(clip))
        elif getattr(getattr(self.model, "speaker_manager", None), "encoder", None) is not None:
            voice = Voice(clip.stem, clip=clip)  # the model embeds the clip itself
        else:
            raise EngineError(f"this Coqui model cannot clone a voice from {clip.name}: it has no speaker encoder")
        with self._lock:
            self._clips[clip] = voice
            while len(self._clips) > CLIP_CACHE_SIZE:
                self._clips.popitem(last=False)
        return voice

    def _xtts_latents(self, clip: Path) -> tuple[Any, Any]:
        import soundfile as sf
        import torch

        try:
            audio, rate = sf.read(str(clip), dtype="float32", always_2d=True)
        except Exception as exc:  # noqa: BLE001 (libsndfile's errors)
            raise EngineError(f"cannot read the reference clip {clip}: {exc}") from exc
        cfg, rate_in = self.config, 22_050  # the rate XTTS's conditioning encoders expect
        mono = resample(audio.mean(axis=1), int(rate), rate_in)[: rate_in * int(cfg.max_ref_len)]
        if cfg.sound_norm_refs and np.abs(mono).max() > 0:
            mono = mono / np.abs(mono).max() * 0.75
        wav = torch.from_numpy(np.ascontiguousarray(mono)).unsqueeze(0).to(self.model.device)
        t0 = time.perf_counter()
        embedding = self.model.get_speaker_embedding(wav, rate_in)
        latent = self.model.get_gpt_cond_latents(wav, rate_in, length=int(cfg.gpt_cond_len),
                                                 chunk_length=int(cfg.gpt_cond_chunk_len))
        log.info("coqui: conditioned on %s in %.2f s", clip.name, time.perf_counter() - t0)
        return latent, embedding

    # --- synthesis -------------------------------------------------------------------

    def stream(self, text: str, voice: Voice, speed: float) -> Iterator[np.ndarray]:
        """One sentence's audio at :attr:`sample_rate`, chunk by chunk (a lazy generator:
        each ``next`` does one chunk's work on the calling thread)."""
        try:
            if self.is_xtts:
                yield from self._xtts(text, voice, speed)
            else:
                yield self._vits(text, voice, speed)
        except (EngineError, GeneratorExit):
            raise
        except Exception as exc:
            raise EngineError(f"Coqui failed on {text[:40]!r}: {exc}") from exc

    def _view(self, speed: float) -> Any:
        with self._lock:
            view = self._views.get(speed)
            if view is None:
                # copy.copy shares the submodules and parameters; only the attribute differs.
                view = copy.copy(self.model)
                view.length_scale = float(self.model.length_scale) / speed
                self._views[speed] = view
                while len(self._views) > SPEED_VIEWS:
                    self._views.popitem(last=False)
            self._views.move_to_end(speed)
            return view

    def _vits(self, text: str, voice: Voice, speed: float) -> np.ndarray:
        import torch

        model = self.model if speed == 1.0 else self._view(speed)
        languages = getattr(self.model.language_manager, "language_names", None) or []
        with torch.inference_mode():
            out = model.synthesize(
                text, speaker=voice.speaker, speaker_wav=None if voice.clip is None else str(voice.clip),
                language=self.language if len(languages) > 1 else None)
        return np.asarray(out["wav"], dtype=np.float32).reshape(-1)

    def _xtts(self, text: str, voice: Voice, speed: float) -> Iterator[np.ndarray]:
        if voice.latents is None:
            raise EngineError(f"XTTS voice {voice.name!r} has no conditioning")
        latent, embedding = voice.latents
        cfg = self.config
        chunks = self.model.inference_stream(
            text, self.language, latent, embedding, stream_chunk_size=self.stream_tokens, speed=speed,
            temperature=cfg.temperature, length_penalty=cfg.length_penalty,
            repetition_penalty=cfg.repetition_penalty, top_k=cfg.top_k, top_p=cfg.top_p)
        for chunk in chunks:
            yield chunk.detach().cpu().numpy().astype(np.float32, copy=False).reshape(-1)


def load_model(ref: str, *, device: str, language: str, stream_tokens: int) -> CoquiModel:
    """Load ``ref`` (a directory, a Coqui model name or a hub repo id); blocking."""
    try:
        import torch
        from TTS.config import load_config
        from TTS.tts.models import setup_model
        from TTS.tts.models.vits import Vits
        from TTS.tts.models.xtts import Xtts
    except ImportError as exc:
        raise ModelError(f"tts.engine coqui needs the coqui-tts package: pip install 'voicebot[coqui]' ({exc})") from exc
    t0 = time.perf_counter()
    directory = model_directory(ref)
    if not (directory / "config.json").is_file():
        raise ModelError(f"Coqui model directory {directory} has no config.json")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        config = load_config(str(directory / "config.json"))
        _point_at_local_files(config, directory)
        model = setup_model(config)
        if isinstance(model, Xtts):
            model.load_checkpoint(config, checkpoint_dir=str(directory), eval=True)
        elif isinstance(model, Vits):
            model.load_checkpoint(config, checkpoint_path=str(find_checkpoint(directory)), eval=True)
        else:
            raise ModelError(f"Coqui model {ref!r} is a {type(model).__name__}: tts.engine coqui runs VITS-family "
                             f"and XTTS models (the ones that make their own waveform)")
        model.to(device)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot load Coqui model {ref!r}: {exc}") from exc
    loaded = CoquiModel(model, config, language=language, stream_tokens=stream_tokens, source=ref)
    if loaded.is_xtts and language not in config.languages:
        raise ModelError(f"tts.coqui_language {language!r} is not one of this XTTS model's: {', '.join(config.languages)}")
    log.info("loaded Coqui %s (%s, %d Hz) on %s in %.1f s", ref, type(model).__name__, loaded.sample_rate,
             device, time.perf_counter() - t0)
    return loaded
