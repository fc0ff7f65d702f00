"""A native ``session.update`` changes what it names, and refuses what it cannot change.

docs/protocol.md: ``session.update`` changes "any ``session.start`` setting except the
rates", and ``session.start`` rejects unknown fields. A typo (``max_token``) or a rate
(``sample_rate``) used to be answered ``session.updated`` and change nothing:
``Session.update_settings`` copies the settings with the fields, and the copy drops names
it does not know (found trying the server as a new user would). A real Session on fake
engines (test_session.make_engines), the native transport's own ``apply_command``.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from fakes import call, clock_of, make_engines
from transformers import AutoTokenizer

from voicebot.errors import VoicebotError
from voicebot.session import events as ev
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings
from voicebot.transports import native
from voicebot.transports.native import apply_command


def run_update(bundle_dir: Callable[[str], str], fields: dict[str, object]) -> tuple[dict | None, SessionSettings, SessionSettings]:
    engines = make_engines(AutoTokenizer.from_pretrained(bundle_dir("qwen3-tokenizer")))

    async def run() -> tuple[dict | None, SessionSettings, SessionSettings]:
        async with Session(engines, SessionSettings.from_config(engines.cfg), clock=clock_of(engines)) as session:
            before = session.settings
            return native.apply_command(session, {"type": "session.update", **fields}), before, session.settings

    return asyncio.run(run())


@pytest.mark.parametrize(
    "fields", [{"max_token": 50}, {"sample_rate": 8000}, {"output_sample_rate": 8000}, {"vad": {"treshold": 0.3}}]
)
def test_an_unknown_or_fixed_field_is_an_error(bundle_dir: Callable[[str], str], fields: dict[str, object]) -> None:
    with pytest.raises(VoicebotError) as err:
        reply, before, after = run_update(bundle_dir, fields)
        pytest.fail(f"session.update {fields} answered {reply}, settings changed: {before != after}")
    assert err.value.code == "invalid_event"
    name = next(iter(fields["vad"])) if "vad" in fields else next(iter(fields))  # type: ignore[call-overload]
    assert name in str(err.value), str(err.value)


@pytest.mark.parametrize("fields", [{"voice": []}, {"turn_detection": {"x": 1.5}}, {"system_prompt": 2.5}])
def test_a_wrong_type_is_an_error_and_nothing_warns(bundle_dir: Callable[[str], str], fields: dict[str, object]) -> None:
    # The update was copied into the settings unvalidated and then dumped to validate it:
    # pydantic warned on stderr for each wrong value (test_fuzz printed dozens) before
    # the error. The error is the whole answer.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(VoicebotError) as err:
            run_update(bundle_dir, fields)
    assert err.value.code == "invalid_event"
    assert next(iter(fields)) in str(err.value), str(err.value)


def test_a_valid_update_changes_what_it_names_and_merges_vad(bundle_dir: Callable[[str], str]) -> None:
    reply, before, after = run_update(bundle_dir, {"max_tokens": 50, "vad": {"threshold": 0.3}})
    assert reply == {"type": "session.updated"}
    assert after.max_tokens == 50 and after.vad.threshold == 0.3
    assert after.vad.min_silence_ms == before.vad.min_silence_ms, "the other VAD settings are kept"


async def _audio_heard_at_speech_start(tokenizer, update: dict[str, Any] | None, **settings: Any) -> float:  # type: ignore[no-untyped-def]
    """Seconds of audio in the ASR buffer once a turn has started (the pre-roll of
    vad.prefix_padding_ms and the speech so far), after 2 s of silence and 400 ms of speech."""
    engines = make_engines(tokenizer)
    async with call(engines, **settings) as c:
        if update is not None:
            assert apply_command(c.session, {"type": "session.update", "vad": update}) == {"type": "session.updated"}
        await c.silence(2000)
        await c.speak(400)
        await c.wait_for(ev.SpeechStarted)
        return float(c.session.listener.asr.buffered_s)


async def test_a_session_update_of_prefix_padding_changes_the_audio_kept_before_speech(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # docs/protocol.md: session.update changes any session.start setting but the rates,
    # vad merged, and vad.prefix_padding_ms is one of the overrides listed; 29eb245 made
    # an update that would change nothing an invalid_event. But the pre-speech ring
    # (prefix_padding_ms + barge_in_min_ms + 100 ms) is sized once, in Session.__init__:
    # the update is acknowledged (session.updated) and the ASR still gets the old
    # padding. A Realtime client's turn_detection.prefix_padding_ms goes the same way
    # (always: its session exists before its first session.update), while its
    # speech_started audio_start_ms is computed with the new value. A barge_in_min_ms
    # raised past the ring cuts the start of every barge-in's words from the ASR.
    vad = make_engines(tokenizer).cfg.vad.model_copy(update={"prefix_padding_ms": 1000})
    at_start = await _audio_heard_at_speech_start(tokenizer, None, vad=vad)
    updated = await _audio_heard_at_speech_start(tokenizer, {"prefix_padding_ms": 1000})
    assert updated == pytest.approx(at_start, abs=0.05), (
        f"prefix_padding_ms 1000: {at_start:.2f} s of audio when set at session.start, "
        f"{updated:.2f} s when set by session.update (acknowledged)"
    )
