"""Model references -> what an engine loads.

A reference is a local path, a Hugging Face hub id, or ``bundle:NAME``. The bundle is
one provider of local directories: once resolved, engines only ever see a path (or,
online, a hub id they pass to their own loader).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from voicebot.config import AsrConfig, Config, ModelsConfig, TtsConfig
from voicebot.errors import BundleError, ModelError
from voicebot.provision.build import model_store, pull
from voicebot.provision.bundle import load_bundle

log = logging.getLogger(__name__)

BUNDLE_PREFIX = "bundle:"


def _looks_like_path(ref: str) -> bool:
    # Hub ids are "org/name" or "name"; these forms can only mean a filesystem path.
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..")


def resolve_model(ref: str, models: ModelsConfig, *, pull: bool = True) -> str:
    """Turn a model reference into a local path (or, online, a hub id).

    - ``bundle:NAME``: the built directory, built now if ``pull`` (else BundleError);
    - an existing local path: itself, made absolute;
    - anything else: a hub id, returned unchanged; with ``models.offline`` that is a
      ModelError, since nothing could download it.
    """
    if ref.startswith(BUNDLE_PREFIX):
        return str(_resolve_bundle(ref.removeprefix(BUNDLE_PREFIX), models, build=pull))
    local = Path(ref).expanduser()
    if local.exists():
        return str(local.resolve())
    if _looks_like_path(ref):
        raise ModelError(f"model path {ref!r} does not exist")
    if models.offline:
        raise ModelError(
            f"model {ref!r} is neither a local path nor bundle:NAME, and models.offline is "
            f"true so the Hugging Face hub is off: set models.offline=false, or use a local "
            f"directory or a bundle entry (`voicebot models list`)"
        )
    return ref


def _resolve_bundle(name: str, models: ModelsConfig, *, build: bool) -> Path:
    entry = load_bundle().get(name)
    if build:
        # Quick check only (size/mtime): this runs at every start-up.
        return pull([entry.name], models, log=log.info, verify=False)[entry.name]
    store = model_store(models)
    problem = store.problem(entry, full=False)
    if problem is not None:
        raise BundleError(
            f"bundle:{name} is {problem} in {store.root}: run `voicebot models pull {name}`"
        )
    return store.path(entry.name)


@dataclass(frozen=True)
class FrontendRefs:
    """The model references ``voicebot serve`` loads itself (resolve_specs resolves them)."""

    asr: str | None  # None: the model lives in the shared ASR service (asr.backend remote)
    llm: str  # with a remote LLM tier only its tokenizer is loaded: llm.tokenizer or llm.model
    tokenizer: str | None  # in-process LLM only, when it differs from the model
    voice: str | None  # the TTS engine's model (tts_model_ref); a shared TTS service (tts.backend remote) takes none


def tts_model_ref(tts: TtsConfig) -> str | None:
    """The model reference the TTS engine loads, resolved like every other: Piper's voice,
    Coqui's model; espeak-ng and Kokoro (which finds its own) take none."""
    if tts.engine == "piper":
        return tts.voice
    if tts.engine == "coqui":
        return tts.coqui_model
    return None


def asr_model_ref(asr: AsrConfig) -> str:
    """The model reference the ASR engine loads: the FastConformer's, else Whisper's."""
    return asr.fastconformer.model if asr.backend == "fastconformer" else asr.model


def frontend_refs(config: Config) -> FrontendRefs:
    remote_llm = config.llm.backend == "remote"
    return FrontendRefs(
        asr=None if config.asr.backend == "remote" else asr_model_ref(config.asr),
        llm=(config.llm.tokenizer or config.llm.model) if remote_llm else config.llm.model,
        tokenizer=None if remote_llm else config.llm.tokenizer,
        voice=tts_model_ref(config.tts) if config.tts.backend == "local" else None,
    )


# The commands that load models, each from the same config file (docs/scaling.md): the
# frontend, and the shared ASR and TTS services.
Role = Literal["serve", "asr-serve", "tts-serve"]
ROLES: tuple[Role, ...] = ("serve", "asr-serve", "tts-serve")


def bundle_names_for(config: Config, *, role: Role = "serve") -> list[str]:
    """The bundle entries ``voicebot ROLE --config`` loads, in config order, without duplicates.

    ``serve``: what the frontend loads itself (:func:`frontend_refs`): not the Whisper
    model of a shared ASR service, of a remote LLM tier only the tokenizer, no voice of a
    shared TTS service. ``asr-serve`` / ``tts-serve``: the model that service hosts.
    """
    if role == "asr-serve":
        refs: list[str | None] = [asr_model_ref(config.asr)]
    elif role == "tts-serve":
        refs = [tts_model_ref(config.tts)]
    else:
        r = frontend_refs(config)
        refs = [r.asr, r.llm, r.tokenizer, r.voice]
    if config.vad.turn_detector == "smart_turn":
        refs.append(config.vad.smart_turn_model)
    names = [r.removeprefix(BUNDLE_PREFIX) for r in refs if r and r.startswith(BUNDLE_PREFIX)]
    return list(dict.fromkeys(names))
