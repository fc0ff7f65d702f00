"""Replies sized for the ear: a reply never stops mid-sentence at ``max_tokens``.

Past ``max_tokens - wind_down_tokens`` the reply stops at its next sentence end; one
that still reaches ``max_tokens`` drops the unfinished sentence, from what is spoken
and from what the history keeps. Words per reply with the real model are a figure of
benchmarks/echo_rate.py (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
from fakes import FakeLlm, FakeTts

from voicebot.session.clauses import sentence_end
from voicebot.session.response import Response


@pytest.mark.parametrize(
    ("text", "whole"),
    [
        ("Sure. I can help", "Sure."),
        ("We open at nine! And close", "We open at nine!"),
        ("Is that all? Yes.", "Is that all? Yes."),
        ('He said "stop." Then', 'He said "stop."'),
        ("It costs 3.", ""),  # "3." may go on as "3.50"
        ("It costs 3.50 today. And", "It costs 3.50 today."),
        ("Ask Mr.", ""),  # a title's stop is not a sentence's
        ("Hi. Mr. Smith is", "Hi."),
        ("No end here", ""),
        ("',...\nencv tai", ""),  # marks with no word before them end no sentence
        ("Ok. ... and", "Ok."),
        ("我们九点开门。周六", "我们九点开门。"),
        # At the end of the text: a contraction, a quote before the mark, a word with
        # letters outside ASCII end their sentence as any word does.
        ("No, I don't.", "No, I don't."),
        ('Good morning is "buenos días".', 'Good morning is "buenos días".'),
        ("¡Buen día!", "¡Buen día!"),
        ("Sure. It's 9 a.m.", "Sure."),  # "a.m." may go on ("a.m. sharp")
        # A list's marker ends no sentence; a number ending a sentence does.
        ("1. Mix the flour. 2. Knead", "1. Mix the flour."),
        ("Steps:\n1. Mix it.\n2. ", "Steps:\n1. Mix it."),
        ("We open at 5. Then", "We open at 5."),
        ("We met in 2024. Then", "We met in 2024."),
    ],
)
def test_sentence_end_finds_the_last_whole_sentence(text: str, whole: str) -> None:
    assert text[: sentence_end(text)] == whole


def reply(text: str, max_tokens: int, wind_down_tokens: int) -> tuple[Response, FakeLlm, FakeTts]:
    llm, tts = FakeLlm(tokenizer=None, reply=text, word_delay=0.0), FakeTts(delay=0.0)
    resp = Response("resp_1", "item_1", [1], llm, tts, voice=None, speed=None,  # type: ignore[arg-type]
                    max_tokens=max_tokens, first_clause_words=3, max_clause_words=24, gated=False,
                    wind_down_tokens=wind_down_tokens)
    return resp, llm, tts


LONG = "We open at nine. The shop closes at six on weekdays. On Sundays we are closed all day long, sorry."


async def test_past_the_wind_down_the_reply_stops_at_its_next_sentence_end() -> None:
    # 16 words: the wind-down starts at word 6 ("The"); the sentence ends at word 11.
    resp, llm, _ = reply(LONG, max_tokens=16, wind_down_tokens=10)
    await resp.run()
    assert resp.full_text == "We open at nine. The shop closes at six on weekdays."
    assert [text for *_, text in resp.playout.spans][-1].endswith("weekdays.")
    assert llm.aborted == ["r0"]  # the request was stopped there, not run to its limit
    assert not resp.cut_at_limit and resp.stats.finish_reason == "stop"


async def test_a_reply_that_reaches_max_tokens_drops_its_unfinished_sentence() -> None:
    # No wind-down: max_tokens falls mid-sentence ("The shop closes at").
    resp, _, _ = reply(LONG, max_tokens=8, wind_down_tokens=0)
    await resp.run()
    spoken = " ".join(text for *_, text in resp.playout.spans)
    assert spoken == "We open at nine."
    assert resp.full_text == "We open at nine."
    assert resp.cut_at_limit and resp.stats.finish_reason == "length"


async def test_a_reply_within_its_limit_is_spoken_whole() -> None:
    resp, llm, _ = reply(LONG, max_tokens=40, wind_down_tokens=10)
    await resp.run()
    assert resp.full_text == LONG
    assert llm.completed == ["r0"] and not resp.cut_at_limit


async def test_a_reply_whose_limit_falls_just_after_a_sentence_end_keeps_that_sentence() -> None:
    # max_tokens falls on "don't.": the reply ends a sentence there, nothing is unfinished.
    resp, _, _ = reply("Yes. I don't. And then", max_tokens=3, wind_down_tokens=0)
    await resp.run()
    spoken = " ".join(text for *_, text in resp.playout.spans)
    assert resp.full_text == "Yes. I don't." == spoken
    assert resp.cut_at_limit is False and resp.stats.finish_reason == "length"


async def test_a_reply_with_nothing_whole_before_its_limit_is_spoken_as_it_is() -> None:
    # No sentence end and no clause cut before max_tokens: dropping the fragment would
    # leave the caller in silence after their turn; a fragment is better than nothing.
    resp, _, _ = reply("Well the thing is that", max_tokens=2, wind_down_tokens=10)
    await resp.run()
    spoken = " ".join(text for *_, text in resp.playout.spans)
    assert spoken == "Well the" == resp.full_text
    assert resp.cut_at_limit is False and resp.stats.finish_reason == "length"


async def test_a_budget_no_larger_than_the_wind_down_has_no_wind_down() -> None:
    # max_tokens=4 with a 32-token wind-down: stopping at the first sentence end would
    # make a cap of a few tokens a one-sentence rule and abort the request early.
    resp, llm, _ = reply("Yes. It is. Fine then.", max_tokens=4, wind_down_tokens=32)
    await resp.run()
    assert resp.stats.finish_reason == "length"
    assert resp.full_text == "Yes. It is."


async def test_a_reply_with_no_sentence_end_keeps_all_it_said_at_its_limit() -> None:
    # A clause was cut ("Well, ") but no sentence ended before max_tokens: dropping the
    # rest would leave "Well," as the whole reply (or only marks: silence).
    resp, _, _ = reply("Well, the thing is that we", max_tokens=5, wind_down_tokens=0)
    await resp.run()
    assert resp.full_text == "Well, the thing is that"
    assert resp.cut_at_limit is False
