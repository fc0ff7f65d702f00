"""Model references -> what an engine loads.

A reference is a local path, a Hugging Face hub id, or ``bundle:NAME``. The bundle is
one provider of local directories: once resolved, engines only ever see a path (or,
online, a hub id they pass to their own loader).
"""

from __future__ import annotations

import logging
from pathlib import Path

from voicebot.config import Config, ModelsConfig
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
    return store.path(name)


def bundle_names_for(config: Config, *, frontend: bool = False) -> list[str]:
    """The bundle entries a config references, in config order, without duplicates.

    ``frontend``: only those ``voicebot serve`` loads itself (as resolve_specs does):
    not the Whisper model of a shared ASR service (``asr.backend: remote``), and of a
    remote LLM tier only the tokenizer.
    """
    refs: list[str | None] = []
    if not (frontend and config.asr.backend == "remote"):
        refs.append(config.asr.model)
    if frontend and config.llm.backend == "remote":
        refs.append(config.llm.tokenizer or config.llm.model)
    else:
        refs += [config.llm.model, config.llm.tokenizer]
    if config.tts.engine == "piper":
        refs.append(config.tts.voice)
    if config.vad.turn_detector == "smart_turn":
        refs.append(config.vad.smart_turn_model)
    names = [r.removeprefix(BUNDLE_PREFIX) for r in refs if r and r.startswith(BUNDLE_PREFIX)]
    return list(dict.fromkeys(names))
