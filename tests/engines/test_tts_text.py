"""The text rules every TTS engine shares (pure): ordered-list markers are not spoken.

A small model asked for steps writes "1. Mix the flour. 2. Knead the dough.", inline or
one item per line; spoken as written the caller hears "one. Mix the flour. two. Knead".
Numbers in prose are spoken as written.
"""

from __future__ import annotations

import pytest

from voicebot.engines.tts.text import (
    clean_text,
    drop_list_markers,
    ends_with_list_number,
    split_sentences,
)


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        # One item per line, after a lead-in.
        ("Here are the steps:\n1. Mix the flour.\n2. Knead the dough.\n3. Bake it.",
         "Here are the steps:\nMix the flour.\nKnead the dough.\nBake it."),
        ("1) Mix the flour\n2) Knead the dough", "Mix the flour\nKnead the dough"),
        ("(1) Mix the flour\n(2) Knead the dough", "Mix the flour\nKnead the dough"),
        # Markdown around the item or the number.
        ("1. **Mix** the flour\n2. **Knead** the dough", "Mix the flour\nKnead the dough"),
        ("**1.** Mix the flour\n**2.** Knead the dough", "Mix the flour\nKnead the dough"),
        # A line-start marker is one whatever its number (the list went on in an earlier clause).
        ("\n4. Let it rise.", "Let it rise."),
        # Inline: a list that starts at 1, after the start, a sentence's end or a colon.
        ("1. Mix the flour. 2. Knead the dough. 3. Bake it.", "Mix the flour. Knead the dough. Bake it."),
        ("Sure! 1. Mix the flour. 2. Knead the dough.", "Sure! Mix the flour. Knead the dough."),
        # After a comma, only a marker that goes on from the last one.
        ("You need three steps: 1) mix, 2) knead, 3) bake.", "You need three steps: mix, knead, bake."),
        ("Do this: 1. Mix the flour. 2. Knead it. 10. Eat.", "Do this: Mix the flour. Knead it. 10. Eat."),
    ],
)
def test_clean_text_drops_ordered_list_markers(text: str, spoken: str) -> None:
    assert clean_text(text) == spoken


@pytest.mark.parametrize(
    "text",
    [
        "It costs 2.50 dollars.",
        "Use version 3.1 of it.",
        "Call 911. They will come.",
        "We met in 2024. Then we moved.",
        # After a word, not a list's place: a number ending a sentence ("at 5. Then").
        "We open at 5. Then we close at 9.",
        "It is 20. 21. 22 is next.",
        # A list's place but no list: a number that is not 1 and follows no marker.
        "How many legs? 8. Spiders have eight.",
        "8. Spiders have eight legs.",
        "It is 3.14 or so. 2 is less.",
        "Rooms 1, 2. And 3 are free.",
        "Add the salt, 1. Then stir.",
    ],
)
def test_clean_text_keeps_numbers_in_prose(text: str) -> None:
    assert clean_text(text) == text


def test_no_sentence_is_a_marker_or_empty() -> None:
    assert split_sentences(clean_text("Sure! 1. Mix the flour. 2. Knead the dough. 3.")) == [
        "Sure!", "Mix the flour.", "Knead the dough."
    ]
    assert split_sentences(clean_text("Steps:\n1.\n2. Knead")) == ["Steps:", "Knead"]


def test_markers_are_judged_in_the_context_before_the_text() -> None:
    # A reply's clause: the text before it says whether its start is a list's place and
    # which number came last.
    assert drop_list_markers("2. Knead the dough.", before="1. Mix the flour. ", last=1) == ("Knead the dough.", 2)
    assert drop_list_markers("2. Knead the dough.", before="Mix the flour.\n", last=0) == ("Knead the dough.", 2)
    assert drop_list_markers("1. Then add salt.", before="Stir for about ", last=0) == ("1. Then add salt.", 0)
    assert drop_list_markers("2. Knead the dough.", before="How many? ", last=0) == ("2. Knead the dough.", 0)


@pytest.mark.parametrize(
    ("head", "marker"),
    [
        ("1.", True),
        ("Sure! 1.", True),
        ("Mix the flour. 2.", True),
        ("Steps:\n**3.", True),
        ("Steps: 12.", True),
        ("Mix, 2.", True),  # permissive: a number alone is no sentence to cut at
        ("We open at 5.", False),
        ("Call 911.", False),
        ("We met in 2024.", False),
        ("It is 21.", False),
        ("Mix the flour. 21.", False),
        ("Mix it.", False),
    ],
)
def test_ends_with_list_number(head: str, marker: bool) -> None:
    assert ends_with_list_number(head) is marker
