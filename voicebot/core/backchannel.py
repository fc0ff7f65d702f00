"""Whether speech over a reply is a turn, or only a backchannel or a noise.

A caller who says "mm-hmm", "okay" or "right" while the bot speaks, or coughs, is
listening, not taking the floor: the reply should go on. The call core pauses a reply
when speech starts over it and asks this module, as the speech's words come in, whether
it is still only that; a word that is not a backchannel, more words than a backchannel
has, or speech that lasts too long make it a turn (a barge-in). Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_NOT_A_WORD = re.compile(r"[^\w\s'-]+")
# A hum, however the recogniser spells it ("mm-hmm", "mhm", "hmmm", "M-M-M"): letters m
# and h only. Whisper writes the same "mm-hmm" differently from one take to the next.
_HUM = re.compile(r"[mh]+(?:-[mh]+)*")


def words_of(text: str) -> list[str]:
    """Lower-case words without punctuation ("Mm-hmm." -> ["mm-hmm"])."""
    return [w.strip("'-") for w in _NOT_A_WORD.sub(" ", text.lower()).split() if w.strip("'-")]


@dataclass(frozen=True)
class FalseInterruptions:
    """What speech over a reply may be and still not be a turn.

    ``words``: backchannel entries (lower case; an entry may be two words); ``hums``:
    any hum is one too ("mhmm", "m-m-m": m and h only);
    ``max_words``: a backchannel has at most this many words; ``max_speech_s``: speech
    over the reply lasting longer than this (from its start to its last sound) is a
    turn whatever its words; ``speech_before_s``: speech the detector heard before it
    reported the start (its barge-in threshold), counted in that duration.
    """

    words: frozenset[str]
    hums: bool = True
    max_words: int = 3
    max_speech_s: float = 1.5
    speech_before_s: float = 0.0

    @classmethod
    def of(cls, words: Iterable[str], **kw: Any) -> FalseInterruptions:
        return cls(frozenset(" ".join(words_of(w)) for w in words if words_of(w)), **kw)

    def as_dict(self) -> dict[str, Any]:
        return {"words": sorted(self.words), "hums": self.hums, "max_words": self.max_words, "max_speech_s": self.max_speech_s,
                "speech_before_s": self.speech_before_s}

    def is_backchannel(self, text: str) -> bool:
        """``text`` (a transcript, or a partial one so far) says nothing but
        backchannel words; nothing at all (a noise) counts as one too."""
        words = words_of(text)
        if len(words) > self.max_words:
            return False
        i = 0
        while i < len(words):
            if i + 1 < len(words) and f"{words[i]} {words[i + 1]}" in self.words:
                i += 2
            elif words[i] in self.words or (self.hums and _HUM.fullmatch(words[i])):
                i += 1
            else:
                return False
        return True
