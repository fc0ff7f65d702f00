"""Cut a streaming LLM reply into speakable clauses for TTS.

A clause ends at sentence punctuation, at a clause mark (, ; : —) once it has a few
words, or, failing those, at a word boundary once it is long. Nothing is ever cut
mid-word: a cut needs the whitespace *after* a word, so a token that may still
continue the word ("Par" + "is") is held back. The first clause is cut early, because
time to first audio is what the caller hears; later clauses are longer so prosody
stays natural.

The first clause is also cut *before* a word that opens a new phrase (a preposition or
conjunction: "We close | at six this evening.") once it has
``_FIRST_MIN_WORDS`` words: at 14 tokens/s on the CPU default each word the first clause
waits for costs ~90 ms before the caller hears anything, and a cut at a phrase border
sounds like a natural breath where a cut at a fixed word count can split "the | shop".
Knowing the next word is such a word takes no longer than the plain word-count cut
(either needs the whitespace after it). And the first clause does not wait for the
whitespace after its punctuation ("Sure." is cut as soon as the "." arrives, a token
sooner) where the mark cannot belong to a number ("3.50") or an abbreviation ("Mr.").

Later clauses are cut as early as the first one while the reply's audio is about to run
out (``running_low``, the reply's judgement: voicebot/session/response.py): on the 2-core
CPU default the model writes only ~1.5 times as fast as the voice speaks, and a whole
sentence waited for after a short first clause left the caller 1-3 s of silence in 10 of
12 replies (docs/benchmarks.md). Otherwise clauses are whole sentences.

No clause ends at the full stop of a title or an initial ("Mr. Dashwood", "St. Louis",
"J. K. Rowling"), of "No." before a number, or of an ordered list's marker ("flour. 2.
Knead"): TTS speaks each clause as a sentence, and "Mr." alone is heard as "Mister." and
a pause, "2." as "two." The head of a buffer counts as a list's place for the marker test
(the text before it is cut off): a clause after a cut at a word boundary ("... at | 5.
Then") is then not cut at "5.", which costs a longer clause, never a word.

Chinese and Japanese are written without spaces: their full-width marks (。！？，、；：) end
a clause with nothing after them, a character counts as half a word, and a long clause is
cut between two characters. Text of any script that runs on without whitespace or a mark
is cut after ``_MAX_RUN_CHARS``: no word is that long, and the reply's audio must not wait
for its end.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

from voicebot.engines.tts.text import drop_list_markers, ends_with_list_number

_SENTENCE_END = ".!?…"
_CLAUSE_MARKS = ",;:—–"
# A cut point: punctuation (optionally followed by closing quotes/brackets) then whitespace.
_PUNCT_CUT = re.compile(r"([.!?…,;:—–][\"')\]]*)(\s+)")
_WORD = re.compile(r"\S+")
_WORD_CHAR = re.compile(r"\w")
# Kana and CJK ideographs: scripts written without spaces between words (Korean has them).
_UNSPACED_CHAR = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
# Their full-width marks, optionally closed by a quote or bracket: a cut needs no space.
_FULLWIDTH_SENTENCE_END = "。！？"
_FULLWIDTH_CLAUSE_MARKS = "，、；："
_FULLWIDTH_CLOSERS = "」』”’）"
_FULLWIDTH_CUT = re.compile(f"([{_FULLWIDTH_SENTENCE_END}{_FULLWIDTH_CLAUSE_MARKS}][{_FULLWIDTH_CLOSERS}]*)\\s*")
_FULLWIDTH_MARK = re.compile(f"[{_FULLWIDTH_SENTENCE_END}{_FULLWIDTH_CLAUSE_MARKS}{_FULLWIDTH_CLOSERS}]")
# A run of text this long with no whitespace or mark is cut anyway (no word is as long).
_MAX_RUN_CHARS = 40
_LONG_RUN = re.compile(f"\\S{{{_MAX_RUN_CHARS}}}")
# Punctuation ending the text so far, after a word of 2+ letters (not "3.", "e.g.", "U.S.").
_TRAILING_MARK = re.compile(r"(?<![\w.'])([A-Za-z]{2,})([.!?…,;:])$")
# Abbreviations whose full stop never ends a sentence: a title or a place's prefix is
# followed by its name ("Mr. Dashwood", "St. Louis"). TTS speaks a clause as a sentence:
# "Mr." cut alone is heard as "Mister." and a pause.
_TITLES = frozenset("mr mrs ms dr prof st mt vs approx capt sgt lt col gen rev".split())
# Abbreviations whose full stop the first clause's early cut does not take: the titles, and
# those that may or may not end a sentence; the next text decides (_not_a_sentence_end).
_ABBREVIATIONS = _TITLES | frozenset("jr sr etc no ft".split())
# The word before a full stop: a title, an initial ("J. K. Rowling"), or "No." before a number.
_WORD_BEFORE_STOP = re.compile(r"(?:^|(?<=[\s(\"']))([A-Za-z.]+)\.$")
# Words the first clause may be cut before once it has _FIRST_MIN_WORDS words.
_FIRST_MIN_WORDS = 2
# A later clause cut while the audio runs low: at a comma or before a phrase from this many
# words on, and at any word boundary once it has _LOW_MAX_WORDS (~1.7 s of speech).
_LOW_MIN_WORDS = 2
_LOW_MAX_WORDS = 5
_PHRASE_STARTS = frozenset(
    # Not "of" or articles: "the capital | of France", "boil | the water" split a phrase.
    """and but or so because if when while that which who where at on in to for with from by
    about after before until into than then""".split()
)

# Words a phrase does not end on (articles, determiners, prepositions, auxiliaries, subject
# pronouns): a cut forced by length after one ("To boil an | egg", "My name is | John")
# is spoken as two broken sentences, so it moves on by up to _MAX_EXTEND words.
_BINDING = frozenset(
    """a an the my your our their his her its this that these those some any every each no
    to of in on at for with from by about into onto over under than as like between through
    across around without within near after before until since during against toward towards
    and or but nor if so because while when where which who whose what how
    is are was were be been being am do does did has have had will would can could should
    shall may might must not very too more most less i we he she they
    i'm you're we're they're he's she's it's that's there's let's i'll you'll we'll they'll
    i've you've we've i'd you'd we'd don't doesn't didn't can't won't isn't aren't wasn't""".split()
)
_MAX_EXTEND = 2
_EDGE_MARKS = "\"'()[]"


def _binds(word: str) -> bool:
    return word.strip(_EDGE_MARKS).lower().replace("\u2019", "'") in _BINDING


class ClauseChunker:
    """``running_low``: True while the reply's audio will run out before a whole sentence
    more can be written; later clauses are then cut early. None: never."""

    def __init__(
        self,
        first_clause_words: int = 6,
        max_clause_words: int = 24,
        *,
        running_low: Callable[[], bool] | None = None,
    ) -> None:
        self.first_clause_words = first_clause_words
        self.max_clause_words = max_clause_words
        self._running_low_fn = running_low
        self._buf = ""
        self._emitted = 0

    def _running_low(self) -> bool:
        return self._emitted > 0 and self._running_low_fn is not None and self._running_low_fn()

    def _limits(self, low: bool) -> tuple[int, int]:
        """(words needed before a comma cut, words that force a cut)."""
        if self._emitted == 0:
            # "Sure," alone is a fine first clause: the caller hears something sooner.
            return 1, self.first_clause_words
        if low:
            return _LOW_MIN_WORDS, min(_LOW_MAX_WORDS, self.max_clause_words)
        return 5, self.max_clause_words

    def push(self, text: str) -> list[str]:
        """Add streamed text; return the clauses that are now complete."""
        self._buf += text
        out: list[str] = []
        # Asked once: the clauses cut here reach the audio ahead only once returned.
        low = self._running_low()
        while (clause := self._next_clause(low and not out)) is not None:
            out.append(clause)
        return out

    def flush(self) -> str | None:
        """End of the reply: whatever is left is the last clause."""
        rest, self._buf = self._buf.strip(), ""
        if not rest:
            return None
        self._emitted += 1
        return rest

    def drop_after(self, end_of: Callable[[str], int]) -> int:
        """Drop what the buffer holds after the position ``end_of(buffer)`` gives (the
        end of its last sentence); return how many characters were dropped."""
        keep = end_of(self._buf)
        dropped = len(self._buf) - keep
        self._buf = self._buf[:keep]
        return dropped

    def _next_clause(self, low: bool = False) -> str | None:
        comma_words, max_words = self._limits(low)
        marks = sorted([*_PUNCT_CUT.finditer(self._buf), *_FULLWIDTH_CUT.finditer(self._buf)], key=lambda m: m.start())
        for m in marks:
            head = self._buf[: m.end(1)]
            words = _words(head)
            if words == 0:
                continue
            mark = m.group(1)[0]
            if mark == "." and _not_a_sentence_end(head, self._buf[m.end() :]):
                continue
            if mark in _SENTENCE_END or mark in _FULLWIDTH_SENTENCE_END or (
                mark in _CLAUSE_MARKS + _FULLWIDTH_CLAUSE_MARKS and words >= comma_words
            ):
                return self._cut(m.end(1), m.end())
        found = list(_WORD.finditer(self._buf))
        if self._emitted == 0:
            trailing = _TRAILING_MARK.search(self._buf)
            if trailing is not None and trailing.group(1).lower() not in _ABBREVIATIONS:
                return self._cut(len(self._buf), len(self._buf))
        if self._emitted == 0 or low:
            # Before a phrase-opening word, once that word is known to be complete.
            for k in range(_FIRST_MIN_WORDS, min(len(found), max_words)):
                w = found[k]
                if w.end() < len(self._buf) and w.group().lower() in _PHRASE_STARTS:
                    return self._cut(found[k - 1].end(), w.start())
        # No punctuation cut: force one at a word boundary once the clause is long, but
        # not after a word the phrase goes on from.
        i = max_words - 1
        while i + 1 < len(found):  # word i is complete: another one has started
            if i >= max_words - 1 + _MAX_EXTEND or not _binds(found[i].group()):
                end = found[i].end()
                return self._cut(end, end + 1) if self._buf[end].isspace() else None
            i += 1
        return self._unspaced_cut(max_words)

    def _unspaced_cut(self, max_words: int) -> str | None:
        """Where words are not spaced: between two characters of such a script once the
        clause is ``max_words`` long, or after a run of ``_MAX_RUN_CHARS`` in any script."""
        chars = list(_UNSPACED_CHAR.finditer(self._buf))
        for a, b in itertools.pairwise(chars):
            if b.start() == a.end() and _words(self._buf[: a.end()]) >= max_words:
                return self._cut(a.end(), a.end())
        run = _LONG_RUN.search(self._buf)
        return self._cut(run.end(), run.end()) if run is not None else None

    def _cut(self, end: int, resume: int) -> str | None:
        clause, self._buf = self._buf[:end].strip(), self._buf[resume:]
        if not clause:
            return None
        self._emitted += 1
        return clause


class ListMarkers:
    """A reply's clauses as TTS is to speak them: without their ordered-list markers
    ("1. Mix the flour." is spoken "Mix the flour."). Only the voice leaves them out: the
    reply's text (its deltas, transcript, history, the words heard) is kept as written.

    Fed the reply's text as the chunker is, it knows what comes before each clause: whether
    "2." stands where a list's item starts, and which marker was dropped last
    (drop_list_markers says when a number is a marker)."""

    def __init__(self) -> None:
        self._text = ""  # the reply so far: bounded by its max_tokens, as its text_parts
        self._end = 0  # where the last clause asked about ends in it
        self._last = 0  # the number of the last marker dropped

    def feed(self, text: str) -> None:
        self._text += text

    def spoken(self, clause: str) -> str:
        """``clause``, the next one cut from the text fed, as TTS is to speak it ("" when
        it was only a marker: a list cut off at its number)."""
        start = self._text.find(clause, self._end)  # a clause is the text fed, stripped
        before = self._text[:start] if start >= 0 else ""
        spoken, self._last = drop_list_markers(clause, before=before, last=self._last)
        self._end = max(start, 0) + len(clause)
        return spoken.strip()


def _words(text: str) -> int:
    """Words in ``text``: spaced words, and two characters of an unspaced script as one."""
    unspaced = len(_UNSPACED_CHAR.findall(text))
    spaced = _FULLWIDTH_MARK.sub(" ", _UNSPACED_CHAR.sub(" ", text))
    return len(_WORD.findall(spaced)) + (unspaced + 1) // 2


def _not_a_sentence_end(head: str, after: str) -> bool:
    """The full stop ending ``head`` belongs to a title, an initial, "No." before a
    number or a list's marker ("flour. 2."; ``after``: the text after the whitespace that
    follows it)."""
    if ends_with_list_number(head):
        return True
    m = _WORD_BEFORE_STOP.search(head)
    if m is None:
        return False
    word = m.group(1)
    if word.lower() in _TITLES:
        return True
    if len(word.replace(".", "")) == 1 and word[0].isupper():
        return True  # "J. K. Rowling"
    return word.lower() == "no" and after[:1].isdigit()


def sentence_end(text: str) -> int:
    """Where the last whole sentence of ``text`` ends (0: none does): after its
    punctuation, followed by whitespace or at the very end, never at a title, an
    initial, "No." before a number, a list's marker ("flour. 2. Knead"), or a number's
    point ("3." may go on as "3.50").
    A sentence has a word: marks with none before them ("',..." from a model that
    starts with punctuation) end nothing, or the reply kept would be silent."""
    end = 0
    for m in _PUNCT_CUT.finditer(text):
        if m.group(1)[0] not in _SENTENCE_END or not _WORD_CHAR.search(text, end, m.start(1)):
            continue
        head = text[: m.end(1)]
        if m.group(1)[0] == "." and _not_a_sentence_end(head, text[m.end() :]):
            continue
        end = m.end(1)
    for m in _FULLWIDTH_CUT.finditer(text):  # "。" ends a sentence with nothing after it
        if m.group(1)[0] in _FULLWIDTH_SENTENCE_END and m.end(1) > end and _WORD_CHAR.search(text, end, m.start(1)):
            end = m.end(1)
    trailing = _TRAILING_SENTENCE_END.search(text.rstrip("\"')]"))
    if trailing is not None and trailing.group(1).lower() not in _ABBREVIATIONS:
        end = len(text.rstrip())
    return end


def up_to_sentence_end(before: str, piece: str) -> tuple[str, bool]:
    """The part of ``piece`` (text that follows ``before``) up to the end of a sentence
    it completes, and whether it completes one."""
    end = sentence_end(before + piece)
    if end <= len(before.rstrip()):
        return piece, False
    return piece[: end - len(before)], True


# A sentence mark ending the text, after a word of 2+ letters in any script, a
# contraction ("don't") or a quoted word ('"días".'); not "3.", "e.g.", "U.S.".
_TRAILING_SENTENCE_END = re.compile(r"(?<![\w.'’])([^\W\d_]{2,}(?:['’][^\W\d_]+)?)[\"'”’)\]]*[.!?…][\"')\]]*$")
