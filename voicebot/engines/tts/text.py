"""The text rules every TTS engine shares: what can be spoken, where sentences end, the speed."""

from __future__ import annotations

import re
import unicodedata

_MD_IMAGE_OR_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_MD_BULLET = re.compile(r"^\s*(?:[-*+•]|#{1,6})\s+", re.MULTILINE)
# Markup characters that would be read out ("asterisk") or that Piper treats as
# syntax: "[[...]]" is Piper's raw-phoneme escape, so LLM text must never reach it.
_MD_MARKS = re.compile(r"[*_`~#|<>\[\]{}\\^]+")
_SPACES = re.compile(r"[ \t\r\f\v]+")
_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+|\n+")
# Symbols, private-use, unassigned, format (zero-width joiners) and modifier
# characters: emoji and friends, nothing a synthesiser can say.
_UNSPEAKABLE = {"So", "Sk", "Cs", "Co", "Cn", "Cf", "Cc"}
_VARIATION_SELECTORS = re.compile("[\ufe00-\ufe0f]")  # category Mn, but emoji-only

# Ordered-list markers ("1.", "2)", "(3)"): a number from 1 to 20 at a list's place, the start
# of the text or a line, or after a sentence's end, a colon or a comma, before its item (or
# the end: a list cut off at its number). Markdown around the number ("**1.**") is allowed.
# Never in prose: "2.50" and "3.1" have no space after the point, and "at 5. Then", "Call
# 911." or "in 2024. Then" put the number after a word or beyond 20.
_LIST_PLACE = r"(?:^|(?<=\n)|(?<=[.!?…:,;]\s)|(?<=[.!?…:,;][\"')\]”’]\s))[ \t*_#]*"
_CLOSERS = "\"')]”’"
_LIST_NUMBER = r"(?:1\d|20|[1-9])"
_LIST_MARKER = re.compile(
    _LIST_PLACE
    + rf"(?:\((?P<bracketed>{_LIST_NUMBER})\)|(?P<number>{_LIST_NUMBER})[.)])[*_]*"
    + r"(?:[ \t]+(?=\S)|[ \t]*(?=\n|$))"
)
_ENDS_WITH_LIST_NUMBER = re.compile(_LIST_PLACE + _LIST_NUMBER + r"\.$")


def clean_text(text: str) -> str:
    """Strip what cannot be spoken (markdown, emoji, control characters); keep line breaks.

    Returns "" when nothing speakable (no letter or digit) is left.
    """
    text = _MD_IMAGE_OR_LINK.sub(r"\1", text)
    text = drop_list_markers(text)[0]
    text = _MD_BULLET.sub("", text)
    text = _MD_MARKS.sub(" ", text)
    text = _VARIATION_SELECTORS.sub("", text)
    text = "".join(
        ch if ch == "\n" or unicodedata.category(ch) not in _UNSPEAKABLE else " " for ch in text
    )
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    text = "\n".join(line for line in lines if line)
    return text if any(ch.isalnum() for ch in text) else ""


def drop_list_markers(text: str, *, before: str = "", last: int = 0) -> tuple[str, int]:
    """``text`` without its ordered-list markers, and the number of the last one dropped.

    ``before``: the text that precedes it (a reply's earlier clauses), which says whether
    its start is a list's place; ``last``: the number of the marker dropped last (0: none).

    The text looks like a list, and a marker is dropped, where the marker starts a line
    (a model's list is one item a line), or is 1 (a list starting: "Sure! 1. Mix"), or
    goes on from the last one dropped ("... flour. 2. Knead"); after a comma only the
    latter ("1) mix, 2) knead"; "Add the salt, 1. Then" is prose). Otherwise the number is
    prose and is spoken: "How many? 8. Spiders have ..." keeps its 8, and "2." before any
    "1." is kept. A "1." that is a sentence of its own after another ("How many? 1. Then
    ...") is taken for a list's start and dropped: a voice reply writes that as "One." far
    less often than a list's first item.

    Dropped, not spoken as an ordinal ("First, mix ..."): each item is spoken as a sentence
    of its own already (TTS cuts at its full stop or line break), an ordinal before an item
    that is a heading or a noun ("First, flour.") sounds odd, and ordinal words are one
    language's while a reply may be in any.
    """
    full = before + text
    parts: list[str] = []
    kept = 0
    for m in _LIST_MARKER.finditer(full):
        start = m.start("number") if m["number"] else m.start("bracketed") - 1
        number = int(m["number"] or m["bracketed"])
        if start >= len(before) and _in_a_list(full[: m.start()], number, last):
            parts.append(full[kept:start])
            kept, last = m.end(), number
    parts.append(full[kept:])
    return "".join(parts)[len(before) :], last


def _in_a_list(before: str, number: int, last: int) -> bool:
    """A marker ``number`` after ``before`` (a list's place) is one, the last dropped being ``last``."""
    if before.endswith("\n"):
        return True  # a line's start: whatever its number
    if before.rstrip().rstrip(_CLOSERS).endswith((",", ";")):
        return 0 < last == number - 1
    return number in (1, last + 1)


def ends_with_list_number(text: str) -> bool:
    """``text`` ends with a number from 1 to 20 and a full stop at a list's place (the
    start, a line's start, after a sentence's end, a colon or a comma): a list's marker,
    not the end of a sentence, whether or not the text goes on to look like a list (a
    bare number is no sentence to speak alone either way)."""
    return _ENDS_WITH_LIST_NUMBER.search(text) is not None


def split_sentences(text: str) -> list[str]:
    """Cut cleaned text after sentence punctuation and at line breaks (list items)."""
    parts = (p.strip() for p in _SENTENCE_END.split(text))
    return [p for p in parts if any(ch.isalnum() for ch in p)]


def resolve_speed(speed: float | None, default: float) -> float:
    value = default if speed is None else speed
    if not value > 0:
        raise ValueError(f"speed must be positive, got {speed!r}")
    # Same bounds as TtsConfig.speed: beyond them both engines turn to mush.
    return min(max(value, 0.25), 4.0)
