"""Reply audio waiting to be played, and which words the caller has heard.

Synthesised audio is appended clause by clause; the pacer takes fixed-size frames off
the front in real time. Every clause's span on the reply's sample timeline is kept,
so any played position maps back to text: the clauses played in full plus the words
of the current clause in proportion to how much of its audio went out. That is what
barge-in keeps in the history.

Synchronous, no I/O: the session's pacer and the tests drive it.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class Playout:
    def __init__(self, sample_rate: int, max_seconds: float = 30.0) -> None:
        self.sample_rate = sample_rate
        self.max_samples = int(max_seconds * sample_rate)
        self._queue: deque[np.ndarray] = deque()
        self._head = 0  # samples already taken from _queue[0]
        self._queued = 0  # samples not yet taken
        self.added = 0  # samples appended since the reply started
        self.taken = 0  # samples taken since the reply started
        self._clause_start = 0
        # (start, end, text) of every finished clause on the reply's timeline. One
        # entry per clause, so it is bounded by the reply length (max_tokens).
        self.spans: list[tuple[int, int, str]] = []

    # ------------------------------------------------------------------ filling
    @property
    def queued_samples(self) -> int:
        return self._queued

    @property
    def queued_ms(self) -> float:
        return 1000.0 * self._queued / self.sample_rate

    def has_room(self) -> bool:
        # Bounded: the TTS side waits when the reply is far ahead of the caller.
        return self._queued < self.max_samples

    def add(self, audio: np.ndarray) -> None:
        """Append audio of the clause being synthesised."""
        if audio.size:
            self._queue.append(audio.astype(np.float32, copy=False))
            self._queued += int(audio.size)
            self.added += int(audio.size)

    def end_clause(self, text: str) -> None:
        """The audio added since the last call speaks ``text``."""
        self.spans.append((self._clause_start, self.added, text))
        self._clause_start = self.added

    # ----------------------------------------------------------------- draining
    def take(self, n: int) -> np.ndarray:
        """Up to ``n`` samples from the front (fewer if that is all there is)."""
        parts: list[np.ndarray] = []
        want = n
        while want > 0 and self._queue:
            buf = self._queue[0]
            chunk = buf[self._head : self._head + want]
            self._head += chunk.size
            want -= chunk.size
            parts.append(chunk)
            if self._head >= buf.size:
                self._queue.popleft()
                self._head = 0
        out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
        self._queued -= out.size
        self.taken += out.size
        return out

    def clear(self) -> int:
        """Drop everything queued (barge-in); return the samples dropped."""
        dropped = self._queued
        self._queue.clear()
        self._head = 0
        self._queued = 0
        return dropped

    # ------------------------------------------------------------------ hearing
    def heard_text(self, played_samples: int | None = None) -> str:
        """Text the caller heard if ``played_samples`` (default: all taken) were played.

        A transport that knows better (Twilio marks, a Realtime client's
        ``audio_end_ms``) passes how much really reached the ear.
        """
        position = self.taken if played_samples is None else max(0, played_samples)
        words: list[str] = []
        for start, end, text in self.spans:
            if position >= end:
                words.extend(text.split())
                continue
            if position > start:
                clause = text.split()
                words.extend(clause[: int(len(clause) * (position - start) / (end - start))])
            break
        return " ".join(words)

    def full_text(self) -> str:
        return " ".join(text for _, _, text in self.spans)
