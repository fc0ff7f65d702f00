"""Whisper's repetition loop: telling a transcript that loops from speech, and cutting it.

On list-like speech (a phone menu: "4 or 6 to decrease or increase the volume, 5 to
extend the conference, 7 or 9 ...") Whisper's decoder can fall into a loop: one phrase
again and again, then one token ("5 5 5 ..."), until its token budget ends. Such a
transcript would go into the LLM's prompt and the conversation history.

Pure and synchronous (no I/O): :mod:`.loop_guard` runs it on every decode of every
backend. Three signs, any one of which is a loop:

- a run of consecutive repetitions of the same words (:func:`find_loop`), at least
  ``MIN_REPEATS`` copies and ``MIN_LOOP_WORDS`` words in all ("no, no, no" is speech;
  "5 to extend the conference" three times over is not), or a whole sentence of
  ``MIN_TWICE_WORDS`` words or more twice in a row (what a forced prefix whose audio is
  gone makes Whisper do: it reads the buffer's first sentence again after it);
- the text compresses too well: Whisper's own test (``compression_ratio_threshold``,
  2.4 on a gzip of the text), on texts long enough for a ratio to mean something;
- more words than the audio can hold (``MAX_WORDS_PER_S``, beyond any real speech).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from voicebot.engines.asr.agreement import normalize_word, split_words

__all__ = ["Loop", "compression_ratio", "cut_loop", "find_loop", "loop_reason"]

COMPRESSION_RATIO_MAX = 2.4  # Whisper's compression_ratio_threshold
_RATIO_MIN_CHARS = 60  # shorter texts are too short to compress at all
MIN_REPEATS = 3
MIN_LOOP_WORDS = 8
MIN_TWICE_WORDS = 8
_MAX_UNIT = 12  # longest repeated phrase looked for, in words
_MAX_CUTS = 8  # runs of copies cut from one text, at most
# Fast conversational speech is 3-4 words a second; a transcript denser than this over
# the whole audio (with a few words of slack for a short clip) is not speech.
MAX_WORDS_PER_S = 6.0
_WORDS_SLACK = 6


@dataclass(frozen=True)
class Loop:
    """``count`` consecutive copies of ``unit`` words, the first at word ``start``."""

    start: int
    unit: int
    count: int

    @property
    def end(self) -> int:
        """Index of the first word after the last copy."""
        return self.start + self.unit * self.count


def compression_ratio(text: str) -> float:
    """Bytes of the text over bytes of its zlib compression (Whisper's measure)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _keys(words: list[str]) -> list[str]:
    # Case and punctuation do not make copies differ ("conference," / "conference.");
    # a punctuation-only word is its own key.
    return [normalize_word(w) or w for w in words]


def find_loop(words: list[str], after: int = 0) -> Loop | None:
    """The earliest run of repeated phrases that makes a loop and goes on past word
    ``after`` (the words before it are a forced prefix: a loop all inside is not news)."""
    keys = _keys(words)
    n = len(keys)
    for start in range(n):
        for unit in range(1, min(_MAX_UNIT, (n - start) // 2) + 1):
            phrase = keys[start : start + unit]
            count = 1
            while keys[start + count * unit : start + (count + 1) * unit] == phrase:
                count += 1
            long_run = count >= MIN_REPEATS and unit * count >= MIN_LOOP_WORDS
            if (long_run or (count >= 2 and unit >= MIN_TWICE_WORDS)) and start + unit * count > after:
                return Loop(start, unit, count)
    return None


def loop_reason(text: str, audio_s: float, after: int = 0) -> str | None:
    """Why ``text`` (the transcript of ``audio_s`` seconds, its first ``after`` words a
    forced prefix) is a loop; None if it is not."""
    words = split_words(text)
    found = find_loop(words, after)
    if found is not None:
        phrase = " ".join(words[found.start : found.start + found.unit])
        return f"{phrase!r} repeated {found.count} times"
    if len(text) >= _RATIO_MIN_CHARS and (ratio := compression_ratio(text)) > COMPRESSION_RATIO_MAX:
        return f"compression ratio {ratio:.1f}"
    if len(words) > audio_s * MAX_WORDS_PER_S + _WORDS_SLACK:
        return f"{len(words)} words in {audio_s:.1f} s of audio"
    return None


def cut_loop(text: str, audio_s: float, keep: int = 0) -> str:
    """``text`` without its loop, and never fewer than its first ``keep`` words (a forced
    prefix, confirmed before): one copy of each run of copies, and what follows a run
    only when it is speech itself (a loop runs on to the token budget: "5 5 5" after the
    phrase's copies is more of it). Without a run of copies (only too dense or too
    compressible), the words the audio can hold."""
    words = split_words(text)
    if find_loop(words, keep) is not None:
        for _ in range(_MAX_CUTS):
            found = find_loop(words, keep)
            if found is None:
                break
            # Copies inside the prefix stay (confirmed); the first one is always kept.
            copies_kept = max(1, -(-(keep - found.start) // found.unit))
            rest = words[found.end :]
            # A loop cut by the token budget ends in the start of one more copy.
            phrase = _keys(words[found.start : found.start + found.unit])
            head = _keys(rest[: found.unit])
            if head == phrase[: len(head)]:
                rest = rest[len(head) :]
            tail = rest if loop_reason(" ".join(rest), audio_s) is None else []
            words = words[: found.start + found.unit * copies_kept] + tail
        return " ".join(words)
    limit = max(keep, int(audio_s * MAX_WORDS_PER_S) + _WORDS_SLACK)
    # Halve what is left until it no longer compresses like a loop.
    while limit > keep and compression_ratio(" ".join(words[:limit])) > COMPRESSION_RATIO_MAX:
        limit = max(keep, limit // 2)
    return " ".join(words[:limit])
