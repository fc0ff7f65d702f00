"""How long to wait, at a pause, before the caller's turn is judged over.

A pure policy over what the server knows at the pause: the end-of-turn model's verdict
on the audio (Smart Turn: P(the turn sounds finished)), the words heard so far (the
pause's own transcript once decoded, else the last partial), and how this caller has
paused inside their turns so far in the call. It answers the silence (ms since the last
speech) after which the turn is over; the detector (voicebot/session/turns.py) ends the
turn when the silence reaches it, and never later than ``max_silence_ms``.

- Words that leave the sentence grammatically open ("... and", "so", "because", a
  comma, an article or preposition, a list or a number being dictated) hold the turn to
  ``max_silence_ms`` whatever the audio sounds like: a caller who stops there goes on.
  So do words that are only an opening: connectives and at most an address ("And so,
  my fellow Americans.", "Well, um.", "So, everyone."), however they are punctuated:
  a speaker who has said nothing yet is taking a breath, not giving the turn away.
- A verdict of "unfinished" holds it to ``max_silence_ms`` too (as before).
- A verdict of "finished" on a transcript that ends without a sentence mark holds it
  too: the recogniser punctuates what sounds finished.
- A verdict of "finished" with closed words ends it at once, unless this caller has
  gone on after long pauses before: then it waits a little past the longest of them
  (capped by ``max_silence_ms``), since the same voice pauses the same way.
- A verdict of "finished" whose words are not known yet waits for them: the reply
  cannot start before that transcript anyway, so waiting costs the caller nothing.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

# Words a sentence does not end on: conjunctions, articles and determiners,
# prepositions, auxiliaries and subject pronouns. A caller who pauses after one of them
# has more to say ("I'd like to book a table for | two people").
_OPEN_WORDS = frozenset(
    """and or but so because if when while though although unless until since as than
    then that which who whose whom where what how whether
    a an the my your our their his her its this these those some any every each another
    to of in on at for with from by about into onto over under between through after
    before during without within like near
    is are was were be been am do does did has have had will would can could should
    shall may might must not
    i we he she they it's i'm we're they're you're he's she's
    um uh er erm""".split()
)
# Said before an item of a list or a number still being given ("one, two and ...",
# "my number is 5 5 5 ..."): the turn goes on after a pause there.
_NUMBER = re.compile(r"(?:\d|\b(?:zero|oh|one|two|three|four|five|six|seven|eight|nine|ten)\b)[\s,.-]*$", re.I)
_DICTATION = re.compile(r"\b(?:number|phone|code|digits?|zip|postcode|account|card|pin)\b", re.I)
_WORD = re.compile(r"[A-Za-z']+")
_SENTENCE_END = ".!?…"
# Words a turn opens with before it says anything. At least one of _GOING_ON must be
# among them: "Now." or "Okay." alone answers a question, "And so." or "Well." does not.
_GOING_ON = frozenset("and so but or well also plus because um uh er erm".split())
_OPENERS = _GOING_ON | frozenset("now then anyway okay ok alright right".split())
# Whom the speaker addresses: said after an opening, it still opens ("And so, my
# fellow Americans", "So, ladies and gentlemen").
_ADDRESS = re.compile(
    r"(?:(?:my|our|you)\s+)?(?:(?:dear|fellow|good|old)\s+)*"
    r"(?:[a-z']+|ladies and gentlemen)",
)
_ADDRESSEES = frozenset(
    """friend friends americans citizens countrymen colleagues folks people everyone everybody
    guys all team ladies gentlemen sir ma'am madam mate pal buddy""".split()
)


def open_ending(words: str) -> str | None:
    """Why ``words`` (what the caller said so far) is grammatically open at its end, or
    None when it may be a finished turn."""
    text = words.strip()
    if not text:
        return None
    stripped = text.rstrip("\"')] ")
    if stripped.endswith((",", ";", ":", "-", "—", "–", "...")):
        return "clause mark"
    if _NUMBER.search(stripped.rstrip(".")) and _DICTATION.search(text[-80:]):
        return "number being dictated"
    last = _WORD.fullmatch(stripped.split()[-1].strip(".!?…\"'()"))
    if stripped[-1:] not in _SENTENCE_END and last and last.group().lower() in _OPEN_WORDS:
        return f"open word {last.group().lower()!r}"
    if not stripped.endswith("?") and (opening := only_an_opening(stripped)):
        return f"only an opening {opening!r}"
    return None


def only_an_opening(words: str) -> str | None:
    """The opening ``words`` are all of (connectives, then at most whom they address),
    or None when they say something."""
    said = [w.lower() for w in _WORD.findall(words)]
    n = 0
    while n < len(said) and said[n] in _OPENERS:
        n += 1
    if not _GOING_ON.intersection(said[:n]):
        return None
    rest = " ".join(said[n:])
    if rest and not (_ADDRESS.fullmatch(rest) and _addressee(rest)):
        return None
    return " ".join(said)


def _addressee(words: str) -> bool:
    """``words`` name whom the speaker addresses ("my fellow Americans", "everyone")."""
    last = words.split()[-1]
    return last in _ADDRESSEES or words.startswith(("fellow ", "my fellow ", "our fellow ", "my dear ", "dear "))


@dataclass(frozen=True)
class TurnPolicyConfig:
    """The detector's limits (from ``vad.*``): ``check_ms`` the silence before the model
    is asked, ``max_silence_ms`` the longest wait, ``threshold`` the verdict that counts
    as finished, ``history_margin_ms`` waited past this caller's longest pause."""

    check_ms: float = 192.0
    max_silence_ms: float = 1500.0
    threshold: float = 0.5
    history_margin_ms: float = 150.0
    words: bool = True  # weigh the words (False: the verdict alone, as Smart Turn)
    history: bool = True  # weigh this caller's pauses


@dataclass(frozen=True)
class Decision:
    """End the turn once the silence reaches ``silence_ms``; ``reason`` says why (logs)."""

    silence_ms: float
    reason: str
    wait_for_words: bool = False  # the words of this pause are due: decide again then


class PauseHistory:
    """The pauses this caller went on after, inside their turns, in this call (ms)."""

    def __init__(self, keep: int = 8) -> None:
        self._pauses: deque[float] = deque(maxlen=keep)  # bounded: the last few pauses

    def went_on_after(self, silence_ms: float) -> None:
        self._pauses.append(silence_ms)

    @property
    def longest_ms(self) -> float | None:
        return max(self._pauses) if self._pauses else None


def decide(
    cfg: TurnPolicyConfig,
    *,
    verdict: float | None,
    words: str | None,
    history: PauseHistory,
    final: bool = True,
) -> Decision:
    """The silence after which the turn is over. ``verdict``: the model's P(finished)
    at this pause, None while unknown; ``words``: the caller's words up to this pause,
    None while their transcript is being decoded; ``final``: they are the pause's own
    transcript (punctuated), not a partial that may lag behind the speech."""
    if not cfg.words:
        words, final = "", False
    if words is not None and (why := open_ending(words)):
        return Decision(cfg.max_silence_ms, why)
    if verdict is None:
        return Decision(cfg.max_silence_ms, "no verdict yet")
    if verdict < cfg.threshold:
        return Decision(cfg.max_silence_ms, f"sounds unfinished ({verdict:.2f})")
    if words is None:
        return Decision(cfg.max_silence_ms, "words not decoded yet", wait_for_words=True)
    if final and words.strip() and words.strip().rstrip("\"')]")[-1:] not in _SENTENCE_END:
        # The recogniser punctuates what sounds finished; it left this sentence open.
        return Decision(cfg.max_silence_ms, "no sentence end in the transcript")
    longest = history.longest_ms if cfg.history else None
    if longest is not None and longest + cfg.history_margin_ms > cfg.check_ms:
        return Decision(min(cfg.max_silence_ms, longest + cfg.history_margin_ms),
                        f"this caller went on after {longest:.0f} ms before")
    return Decision(cfg.check_ms, f"finished ({verdict:.2f})")
