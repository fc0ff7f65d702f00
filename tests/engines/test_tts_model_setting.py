"""``tts.model``: one setting for the TTS engine's model, whatever the engine.

It stands for Piper's ``tts.voice`` (a voice directory or bundle), Kokoro's
``tts.kokoro_model`` and Coqui's ``tts.coqui_model``; espeak-ng loads no model, so setting it
there is a configuration error. The config maps it once (``TtsConfig``'s validator): these
tests check that every reader (the registry, ``tts-serve``'s reference, ``models pull``)
sees it, and that the engines' own settings go on working when it is not set. No engine
is started.
"""

from __future__ import annotations

import pytest

from voicebot.config import TTS_MODEL_FIELDS, Config, TtsConfig, load_config
from voicebot.engines.registry import create_tts
from voicebot.engines.tts.coqui import CoquiTts
from voicebot.engines.tts.kokoro import KokoroTts
from voicebot.errors import ConfigError, ModelError
from voicebot.provision import bundle_names_for
from voicebot.provision.resolve import frontend_refs, tts_model_ref


@pytest.mark.parametrize(("engine", "field"), [("piper", "voice"), ("kokoro", "kokoro_model"),
                                               ("coqui", "coqui_model")])
def test_tts_model_is_the_engines_own_model_setting(engine: str, field: str) -> None:
    cfg = load_config("configs/test.yaml", [f"tts.engine={engine}", "tts.model=/models/mine"])
    assert TTS_MODEL_FIELDS[engine] == field
    assert getattr(cfg.tts, field) == "/models/mine"
    # The other engines' settings keep their values.
    for other in set(TTS_MODEL_FIELDS.values()) - {field}:
        assert getattr(cfg.tts, other) == getattr(load_config("configs/test.yaml").tts, other)


def test_tts_model_replaces_the_engines_setting_from_the_file() -> None:
    # A config file names one Coqui model; the command line's tts.model wins, as any --set.
    cfg = load_config("configs/test.yaml", ["tts.engine=coqui", "tts.coqui_model=/models/old",
                                            "tts.model=/models/new"])
    assert cfg.tts.coqui_model == "/models/new"


def test_without_tts_model_the_engines_settings_work_as_before() -> None:
    cfg = load_config("configs/test.yaml", ["tts.engine=coqui", "tts.coqui_model=/models/vits"])
    assert cfg.tts.model is None and cfg.tts.coqui_model == "/models/vits"
    assert tts_model_ref(cfg.tts) == "/models/vits"
    piper = TtsConfig(engine="piper", voice="bundle:piper-en_US-joe-medium")
    assert tts_model_ref(piper) == "bundle:piper-en_US-joe-medium"
    assert TtsConfig(engine="kokoro", kokoro_model="/k").kokoro_model == "/k"


def test_espeak_has_no_model_to_set() -> None:
    with pytest.raises(ConfigError, match="tts.model is set but tts.engine espeak loads no model"):
        load_config("configs/test.yaml", ["tts.engine=espeak", "tts.model=/models/mine"])
    with pytest.raises(ConfigError, match="tts.model"):
        load_config("configs/test.yaml", ["tts.engine=coqui", "tts.model="])  # empty: not a model


def test_a_change_of_engine_at_run_time_maps_it_again() -> None:
    tts = TtsConfig(engine="coqui", model="/models/mine")
    tts.engine = "kokoro"
    assert tts.kokoro_model == "/models/mine"
    tts.model = "/models/other"
    assert tts.kokoro_model == "/models/other" and tts.coqui_model == "/models/mine"


def test_every_reader_gets_the_model() -> None:
    cfg = load_config("configs/test.yaml", ["tts.engine=coqui", "tts.model=/models/mine"])
    # The frontend resolves it (resolve_specs) and the registry hands it to the engine.
    assert frontend_refs(cfg).voice == "/models/mine"
    engine = create_tts(cfg.tts, frontend_refs(cfg).voice)
    assert isinstance(engine, CoquiTts) and engine._ref == "/models/mine"
    # tts-serve hosts the engine for frontends whose tts.backend is remote.
    remote = load_config("configs/test.yaml", ["tts.engine=coqui", "tts.model=/models/mine", "tts.backend=remote"])
    assert frontend_refs(remote).voice is None
    assert tts_model_ref(remote.tts.model_copy(update={"backend": "local"})) == "/models/mine"
    # Kokoro finds its model itself, from its own setting.
    kokoro = load_config("configs/test.yaml", ["tts.engine=kokoro", "tts.model=/models/kokoro"])
    engine = create_tts(kokoro.tts, frontend_refs(kokoro).voice)
    assert isinstance(engine, KokoroTts) and engine._cfg.kokoro_model == "/models/kokoro"


def test_models_pull_takes_a_bundled_model_named_by_tts_model() -> None:
    config = Config()
    config.tts.engine = "espeak"
    config.tts.voice = "en-us"
    assert bundle_names_for(config, role="tts-serve") == []
    config.tts.engine = "piper"
    config.tts.model = "bundle:piper-en_US-joe-medium"
    assert config.tts.voice == "bundle:piper-en_US-joe-medium"
    assert bundle_names_for(config, role="tts-serve") == ["piper-en_US-joe-medium"]


def test_a_piper_engine_without_a_resolved_voice_names_both_settings() -> None:
    with pytest.raises(ModelError, match=r"tts.model or tts.voice"):
        create_tts(TtsConfig(engine="piper"), None)
