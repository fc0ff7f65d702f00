"""Whisper's repetition loop: no transcript that loops leaves the ASR engine.

The signs of a loop and the cut are pure (``voicebot.engines.asr.repetition``); the guard
(``loop_guard.LoopGuard``) is tested through the engine with the scripted Whisper of
tests/fake_whisper.py behind our own ``WhisperRunner`` seam, which loops the way Whisper
does when greedy. tests/engines/test_asr.py runs the real model on a spoken menu.
"""

from __future__ import annotations

import asyncio

import pytest
from fake_whisper import WAIT, LoopingWhisper, audio

from voicebot.config import AsrConfig
from voicebot.engines.asr.agreement import continuation_after
from voicebot.engines.asr.loop_guard import token_budget
from voicebot.engines.asr.repetition import compression_ratio, cut_loop, find_loop, loop_reason
from voicebot.engines.asr.vllm_whisper import VllmAsrEngine, WhisperVllmSettings

MENU = (
    "During the conference, press 1 to mute or unmute your line, 2 to hear the number of "
    "participants, 3 to lock or unlock the conference, 4 or 6 to decrease or increase the "
    "conference volume, 5 to extend the conference, 7 or 9 to decrease or increase your own "
    "volume, 8 to record the conference, and 0 to reach the operator."
)
# What came back for that prompt over /v1/realtime: the phrase ~40 times, then "5 5 5".
LOOPED = MENU.split(", 5 to extend")[0] + ", 5 to extend the conference" * 40 + " 5" * 60


def test_speech_with_lists_and_repeated_words_is_not_a_loop() -> None:
    assert loop_reason(MENU, 19.0) is None
    assert loop_reason("No, no, no. I said the second one, not the first one.", 3.0) is None
    assert loop_reason("Yes yes. Bye bye.", 1.5) is None
    assert loop_reason("Press 1, press 1, press 1 again.", 2.5) is None  # 3 copies, 6 words
    assert compression_ratio(MENU) < 2.4


def test_a_repeated_phrase_a_repeated_word_and_a_dense_text_are_loops() -> None:
    assert loop_reason(LOOPED, 19.0) == "'5 to extend the conference,' repeated 40 times"
    assert loop_reason("The number is " + "5 " * 12, 4.0) == "'5' repeated 12 times"
    found = find_loop("a b c d e f g h a b c d e f g h a b c d e f g h".split())
    assert found is not None and (found.start, found.unit, found.count) == (0, 8, 3)
    # No copies in a row, but more words than 5 s of speech can hold.
    assert loop_reason(MENU, 5.0) == f"{len(MENU.split())} words in 5.0 s of audio"


def test_a_sentence_read_twice_in_a_row_is_cut_to_one_copy_and_the_rest_kept() -> None:
    # What whisper-base made of a 32 s spoken menu once the head of the buffer was gone
    # and its confirmed words were forced: the buffer's first sentence again after them.
    doubled = (
        "Welcome to the conference bridge. During the conference, press 1 to mute or unmute "
        "your line. During the conference, press 1 to mute or unmute your line. 2. To hear "
        "the number of participants. 3. To lock or unlock the conference."
    )
    assert loop_reason(doubled, 20.0) == "'During the conference, press 1 to mute or unmute your line.' repeated 2 times"
    assert cut_loop(doubled, 20.0) == doubled.replace(" During the conference, press 1 to mute or unmute your line.", "", 1)
    assert loop_reason("I need an agent. I need an agent.", 3.0) is None  # a short request said twice is speech
    # The first copy was the forced prefix (confirmed words), the second its continuation.
    prefix = doubled.split(" During")[0] + " During the conference, press 1 to mute or unmute your line."
    forced = len(prefix.split())
    assert loop_reason(doubled, 20.0, after=forced) is not None
    assert loop_reason(doubled, 20.0, after=len(doubled.split())) is None  # all of it confirmed
    assert continuation_after(cut_loop(doubled, 20.0, keep=forced), prefix) == (
        "2. To hear the number of participants. 3. To lock or unlock the conference."
    )


def test_a_loop_is_cut_after_its_first_copy() -> None:
    cut = cut_loop(LOOPED, 19.0)
    assert cut.endswith("volume, 5 to extend the conference,")
    assert loop_reason(cut, 19.0) is None
    assert cut_loop("The number is " + "5 " * 12, 4.0) == "The number is 5"
    assert cut_loop(MENU, 5.0).split() == MENU.split()[: 5 * 6 + 6]


def test_the_token_budget_follows_the_audio_within_whispers_window() -> None:
    assert token_budget(2.0, 4, 8.0) == 2 * 8 + 16
    assert token_budget(30.0, 4, 8.0) == 30 * 8 + 16
    assert token_budget(30.0, 300, 8.0) == 448 - 300 - 1
    assert token_budget(30.0, 447, 8.0) == 1


def engine(fake: LoopingWhisper, **cfg: object) -> VllmAsrEngine:
    asr_cfg = AsrConfig(backend="vllm", partial_interval_ms=500, agreement_n=2, **cfg)  # type: ignore[arg-type]
    return VllmAsrEngine(asr_cfg, "fake-whisper", agreement_n=2, settings=WhisperVllmSettings(concurrency=2), runner=fake)


async def test_a_final_that_loops_is_decoded_again_at_a_fallback_temperature() -> None:
    fake = LoopingWhisper()
    async with engine(fake) as eng:
        result = await asyncio.wait_for(eng.transcribe(audio(3.0)), WAIT)
        assert result.text == "alpha bravo charlie delta echo foxtrot"
        # Greedy first, bounded by the audio's length; then the fallback, which did not loop.
        assert [c["temperature"] for c in fake.calls] == [0.0, 0.4]
        assert [c["max_tokens"] for c in fake.calls] == [3 * 8 + 16] * 2
        assert (eng.decoder.loops, eng.decoder.cut) == (1, 0)


async def test_a_final_that_loops_at_every_temperature_is_cut_after_the_first_copy() -> None:
    fake = LoopingWhisper(loops_when_sampling=True)
    async with engine(fake) as eng:
        result = await asyncio.wait_for(eng.transcribe(audio(3.0)), WAIT)
        assert result.text == "alpha bravo charlie delta echo foxtrot"
        assert [c["temperature"] for c in fake.calls] == [0.0, 0.4, 0.8]
        assert (eng.decoder.loops, eng.decoder.cut) == (1, 1)


async def test_a_partial_that_loops_is_cut_without_a_second_decode() -> None:
    fake = LoopingWhisper()
    async with engine(fake) as eng:
        stream = eng.stream()
        stream.push(audio(2.0))
        partial = await asyncio.wait_for(anext(stream), WAIT)
        assert partial.text == "alpha bravo charlie delta"
        assert [c["temperature"] for c in fake.calls] == [0.0]
        # Its final goes through the fallback as any final.
        final = await asyncio.wait_for(stream.finalize(), WAIT)
        assert final.text == "alpha bravo charlie delta"
        assert [c["temperature"] for c in fake.calls] == [0.0, 0.0, 0.4]
        await stream.aclose()


async def test_no_fallback_temperatures_cut_at_once() -> None:
    fake = LoopingWhisper()
    async with engine(fake, loop_fallback_temperatures=[]) as eng:
        result = await asyncio.wait_for(eng.transcribe(audio(3.0)), WAIT)
        assert result.text == "alpha bravo charlie delta echo foxtrot"
        assert len(fake.calls) == 1


@pytest.mark.parametrize("temperatures", [[0.4], [0.2, 0.6, 1.0]])
def test_fallback_temperatures_are_config(temperatures: list[float]) -> None:
    assert AsrConfig(loop_fallback_temperatures=temperatures).loop_fallback_temperatures == temperatures
