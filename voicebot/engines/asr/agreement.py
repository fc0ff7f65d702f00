"""LocalAgreement-n: which words of a streaming ASR hypothesis are stable.

Pure and synchronous (no I/O); :mod:`voicebot.engines.asr.stream` feeds it one
hypothesis per partial decode. A word becomes *confirmed* once n consecutive hypotheses
agree on it (and on every word before it); confirmed words are never changed or withdrawn.

Hypotheses are passed as the words that follow the confirmed ones: the engine decodes
with the confirmed text forced as Whisper's ``prefix``, so every hypothesis starts with
the confirmed words by construction and only its continuation is open.
"""

from __future__ import annotations

import string

from voicebot.engines.contracts import join_text

_STRIP = string.punctuation + "“”‘’…–—"


def normalize_word(word: str) -> str:
    """Comparison key: case and surrounding punctuation do not make words differ."""
    return word.strip(_STRIP).lower()


def _same(a: str, b: str) -> bool:
    key_a, key_b = normalize_word(a), normalize_word(b)
    # Punctuation-only tokens ("," glued after a confirmed word) have an empty key:
    # they agree only if they are identical.
    return key_a == key_b if key_a or key_b else a == b


def split_words(text: str) -> list[str]:
    """Whitespace-separated words, punctuation kept (it is shown to the user)."""
    return text.split()


class LocalAgreement:
    """LocalAgreement-n over word lists (n = 2: two consecutive hypotheses must agree).

    ``hold_back`` words at the end of the newest hypothesis are never confirmed, even
    if two hypotheses agree on them: the last word often sits on the buffer's edge and is
    cut ("leisure" for "leisurely") or carries a sentence-final period Whisper adds only
    because the audio stops there.
    """

    def __init__(self, n: int = 2, hold_back: int = 1) -> None:
        if n < 2 or hold_back < 0:
            raise ValueError("need n >= 2 and hold_back >= 0")
        self._n = n
        self._hold_back = hold_back
        self._confirmed: list[str] = []
        # Continuations (after the confirmed words) of the last n - 1 hypotheses, oldest first.
        self._recent: list[list[str]] = []

    @property
    def confirmed(self) -> list[str]:
        return list(self._confirmed)

    @property
    def tentative(self) -> list[str]:
        return list(self._recent[-1]) if self._recent else []

    @property
    def confirmed_text(self) -> str:
        text = ""
        for word in self._confirmed:
            text = join_text(text, word)
        return text

    @property
    def tentative_text(self) -> str:
        return " ".join(self.tentative)

    def update(self, continuation: list[str]) -> list[str]:
        """Take the words a new hypothesis has after the confirmed ones; return newly confirmed."""
        recent = [*self._recent, list(continuation)][-self._n :]
        k = 0
        if len(recent) == self._n:
            limit = min(len(continuation) - self._hold_back, *(len(h) for h in recent))
            while k < limit and all(_same(h[k], continuation[k]) for h in recent):
                k += 1
        # The newest hypothesis's spelling wins: it saw the most audio after the word.
        newly = continuation[:k]
        self._confirmed.extend(newly)
        self._recent = [h[k:] for h in recent][-(self._n - 1) :]
        return newly

    def reset(self) -> None:
        self._confirmed.clear()
        self._recent = []


def continuation_after(decoded: str, prefix: str) -> str:
    """The text a decode forced with ``prefix`` added after it, joinable with :func:`join_text`.

    CTranslate2 returns the forced prefix tokens as part of the result, so the decoded
    text normally starts with the prefix verbatim.
    """
    decoded, prefix = decoded.strip(), prefix.strip()
    if not prefix:
        return decoded
    if decoded.startswith(prefix):
        rest = decoded[len(prefix) :]
        # Letters glued to the last confirmed word ("leisure" + "ly") would change a
        # confirmed word; they become a word of their own instead.
        if rest[:1].isalnum():
            rest = " " + rest
        return rest.strip() if rest[:1].isspace() else rest
    # No prefix in the output: Whisper dropped the segment as no-speech, or the
    # tokenizer did not round-trip. Fall back to word alignment, else nothing new.
    words, want = split_words(decoded), [normalize_word(w) for w in split_words(prefix)]
    if [normalize_word(w) for w in words[: len(want)]] == want:
        return " ".join(words[len(want) :])
    return ""
