"""The end-of-turn policy: how long to wait at a pause, from the model's verdict, the
words so far and this caller's pauses (voicebot/core/turn_policy.py)."""

from __future__ import annotations

import pytest

from voicebot.core.turn_policy import PauseHistory, TurnPolicyConfig, decide, open_ending

CFG = TurnPolicyConfig(check_ms=192, max_silence_ms=1500, threshold=0.5, history_margin_ms=150)


@pytest.mark.parametrize(
    ("words", "why"),
    [
        ("I'd like to book a table and", "open word 'and'"),
        ("I was thinking so", "open word 'so'"),
        ("I can't come because", "open word 'because'"),
        ("We need eggs, milk,", "clause mark"),
        ("I'd like a table for the", "open word 'the'"),
        ("Can I speak to", "open word 'to'"),
        ("Well, um", "open word 'um'"),
        ("And so my fellow Americans, ask not", "open word 'not'"),
        ("My phone number is 5 5 5", "number being dictated"),
        ("my account number is one two three", "number being dictated"),
        ("What time do you open on Sundays?", None),
        ("I want to cancel my subscription.", None),
        # Only an opening: connectives, then at most whom they address, however punctuated.
        ("And so, my fellow Americans.", "only an opening 'and so my fellow americans'"),
        ("And so my fellow Americans", "only an opening 'and so my fellow americans'"),
        ("So, ladies and gentlemen.", "only an opening 'so ladies and gentlemen'"),
        ("Well, um.", "only an opening 'well um'"),
        ("Okay, so.", "only an opening 'okay so'"),
        ("And so.", "only an opening 'and so'"),
        # ... but an opening that says something, asks, or answers is not held by this rule.
        ("And so my fellow Americans, ask not what your country can do for you.", None),
        ("So I'd like to book a table.", None),
        ("So my car.", None),
        ("And you?", None),
        ("Okay.", None),
        ("Now.", None),
        ("My fellow Americans.", None),  # no opening: the other signals decide
        ("It is 5", None),  # a number, but nothing is being dictated
        ("", None),
    ],
)
def test_open_endings(words: str, why: str | None) -> None:
    assert open_ending(words) == why


@pytest.mark.parametrize(
    ("verdict", "words", "final", "silence_ms", "wait_for_words"),
    [
        # finished audio, finished words: at once
        (0.9, "What time do you open on Sundays?", True, 192, False),
        # finished audio, open words: the words win
        (0.9, "I'd like a table for two and", True, 1500, False),
        (0.9, "We need eggs, milk,", False, 1500, False),
        # unfinished audio: hold, as before
        (0.2, "What time do you open on Sundays?", True, 1500, False),
        # no verdict yet: nothing ends the turn before the cap
        (None, "What time do you open?", True, 1500, False),
        # the pause's transcript is being decoded: wait for it (the reply needs it anyway)
        (0.9, None, True, 1500, True),
        # a transcript the recogniser left unpunctuated: hold
        (0.9, "And so my fellow Americans", True, 1500, False),
        # a partial (it may lag the speech) is read for open words only
        (0.9, "What time do you open on Sundays", False, 192, False),
        # only an opening, punctuated as a sentence: the words hold the turn
        (0.98, "And so, my fellow Americans.", True, 1500, False),
    ],
)
def test_decide_without_history(verdict: float | None, words: str | None, final: bool, silence_ms: float,
                                wait_for_words: bool) -> None:
    d = decide(CFG, verdict=verdict, words=words, history=PauseHistory(), final=final)
    assert (d.silence_ms, d.wait_for_words) == (silence_ms, wait_for_words), d.reason
    assert d.reason


def test_a_caller_who_went_on_after_long_pauses_is_waited_for_a_little_longer() -> None:
    history = PauseHistory()
    finished = {"verdict": 0.9, "words": "Ask what you can do for your country.", "history": history}
    assert decide(CFG, **finished).silence_ms == 192  # type: ignore[arg-type]
    history.went_on_after(600)
    history.went_on_after(400)
    d = decide(CFG, **finished)  # type: ignore[arg-type]
    assert d.silence_ms == 750 and "600" in d.reason  # past the longest of them
    history.went_on_after(2000)
    assert decide(CFG, **finished).silence_ms == 1500  # type: ignore[arg-type]  # never past the cap


def test_the_pause_history_is_bounded() -> None:
    history = PauseHistory(keep=3)
    for ms in (900, 100, 200, 300):
        history.went_on_after(ms)
    assert history.longest_ms == 300  # the oldest went out


def test_each_signal_can_be_switched_off() -> None:
    history = PauseHistory()
    history.went_on_after(600)
    audio_only = TurnPolicyConfig(words=False, history=False)
    # The verdict alone, as Smart Turn: open words and the caller's pauses are not read.
    assert decide(audio_only, verdict=0.9, words="a table for two and", history=history).silence_ms == 192
    no_history = TurnPolicyConfig(history=False)
    assert decide(no_history, verdict=0.9, words="Yes.", history=history).silence_ms == 192
    assert decide(no_history, verdict=0.9, words="a table for two and", history=history).silence_ms == 1500
