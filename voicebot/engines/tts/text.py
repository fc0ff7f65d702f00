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


def clean_text(text: str) -> str:
    """Strip what cannot be spoken (markdown, emoji, control characters); keep line breaks.

    Returns "" when nothing speakable (no letter or digit) is left.
    """
    text = _MD_IMAGE_OR_LINK.sub(r"\1", text)
    text = _MD_BULLET.sub("", text)
    text = _MD_MARKS.sub(" ", text)
    text = _VARIATION_SELECTORS.sub("", text)
    text = "".join(
        ch if ch == "\n" or unicodedata.category(ch) not in _UNSPEAKABLE else " " for ch in text
    )
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    text = "\n".join(line for line in lines if line)
    return text if any(ch.isalnum() for ch in text) else ""


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
