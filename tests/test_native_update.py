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
from collections.abc import Callable

import pytest
from test_session import clock_of, make_engines
from transformers import AutoTokenizer

from voicebot.errors import VoicebotError
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings
from voicebot.transports import native


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


def test_a_valid_update_changes_what_it_names_and_merges_vad(bundle_dir: Callable[[str], str]) -> None:
    reply, before, after = run_update(bundle_dir, {"max_tokens": 50, "vad": {"threshold": 0.3}})
    assert reply == {"type": "session.updated"}
    assert after.max_tokens == 50 and after.vad.threshold == 0.3
    assert after.vad.min_silence_ms == before.vad.min_silence_ms, "the other VAD settings are kept"
