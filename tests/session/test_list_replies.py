"""Replies sized for the ear: a reply written as an ordered list is spoken without its markers.

A small model asked for steps writes "1. Mix the flour. 2. Knead the dough.", inline or
one item per line. The caller hears the items ("Mix the flour. Knead the dough."), not
"one. Mix the flour. two. Knead"; the reply's text (its deltas, its transcript, the
history) keeps what the model wrote.
"""

from __future__ import annotations

import re

import pytest
from fakes import FakeLlm, FakeTts

from voicebot.session.clauses import ClauseChunker, ListMarkers
from voicebot.session.response import Response


def spoken_clauses(text: str, first_clause_words: int = 8) -> list[str]:
    """The clauses of ``text`` streamed word by word, as TTS is asked to speak them."""
    chunker, lists = ClauseChunker(first_clause_words, max_clause_words=24), ListMarkers()
    out: list[str] = []
    for piece in re.findall(r"\s*\S+", text):
        lists.feed(piece)
        out += [lists.spoken(clause) for clause in chunker.push(piece)]
    if (rest := chunker.flush()) is not None:
        out.append(lists.spoken(rest))
    return out


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("Sure! 1. Mix the flour. 2. Knead the dough. 3. Bake it.",
         ["Sure!", "Mix the flour.", "Knead the dough.", "Bake it."]),
        ("Here are the steps:\n\n1. **Mix** the flour.\n2. Knead the dough.\n3. Bake it.",
         ["Here are the steps:", "**Mix** the flour.", "Knead the dough.", "Bake it."]),
        # Items with no full stop: one clause, one item a line (TTS cuts at line breaks).
        ("Steps:\n1) Mix the flour\n2) Knead the dough\n3) Bake it",
         ["Steps:", "Mix the flour\nKnead the dough\nBake it"]),
        # The list goes on across clauses: "2." starts a clause of its own.
        ("1. Mix the flour, water, salt and yeast in a big bowl until it holds together. 2. Knead it well.",
         ["Mix the flour,", "water, salt and yeast in a big bowl until it holds together.", "Knead it well."]),
        ("1. Mix the flour. 2.", ["Mix the flour.", ""]),
        # Prose: spoken as written.
        ("How many legs? 8. Spiders have eight.", ["How many legs?", "8. Spiders have eight."]),
        ("Yes. Call 911. They will come.", ["Yes.", "Call 911.", "They will come."]),
        ("Yes. We open at 5. Then we close.", ["Yes.", "We open at 5.", "Then we close."]),
    ],
)
def test_the_clauses_spoken_carry_no_list_markers(text: str, spoken: list[str]) -> None:
    assert spoken_clauses(text) == spoken


def reply(text: str, max_tokens: int = 64) -> tuple[Response, FakeTts]:
    llm, tts = FakeLlm(tokenizer=None, reply=text, word_delay=0.0), FakeTts(delay=0.0)
    resp = Response("resp_1", "item_1", [1], llm, tts, voice=None, speed=None,  # type: ignore[arg-type]
                    max_tokens=max_tokens, first_clause_words=3, max_clause_words=24, gated=False)
    return resp, tts


def deltas_text(resp: Response) -> str:
    out: list[str] = []
    while (delta := resp.deltas.get_nowait()) is not None:
        assert isinstance(delta, str)
        out.append(delta)
    return "".join(out)


async def test_a_listed_reply_is_spoken_without_markers_and_written_with_them() -> None:
    text = "Sure! 1. Mix the flour. 2. Knead the dough. 3. Bake it."
    resp, tts = reply(text)
    await resp.run()
    assert tts.texts == ["Sure!", "Mix the flour.", "Knead the dough.", "Bake it."]
    assert resp.full_text == text  # the history's reply and response.done's text
    assert deltas_text(resp) == text  # response.text.delta / audio_transcript.delta
    assert resp.playout.heard_text(resp.playout.added) == text  # a reply cut short keeps the words heard, as written


async def test_a_list_cut_off_at_its_marker_speaks_no_empty_clause() -> None:
    resp, tts = reply("1. Mix the flour. 2.")
    await resp.run()
    assert tts.texts == ["Mix the flour."]
    assert resp.full_text == "1. Mix the flour. 2."


async def test_a_listed_reply_at_max_tokens_ends_at_its_last_item_not_at_a_marker() -> None:
    # The limit falls in item 2 ("2. Knead the"): a marker is no sentence end to keep.
    resp, tts = reply("1. Mix the flour. 2. Knead the dough.", max_tokens=7)
    await resp.run()
    assert resp.cut_at_limit
    assert resp.full_text == "1. Mix the flour."
    assert tts.texts == ["Mix the flour."]
