"""End-of-turn and barge-in decisions from VAD probabilities.

A plain synchronous state machine fed one VAD window at a time, so it can be tested
without audio or clocks. It speaks in signals; the session decides what they mean.

    SPEECH_START    speech lasted ``min_speech_ms`` (``barge_in_min_ms`` while the bot
                    talks, so a cough does not cut the reply off)
    QUIET           the first silent window after speech: decode what was said now, so
                    the transcript is ready by the time the pause is long enough
    PAUSE           ``speculative_silence_ms`` of silence after speech: a good moment to
                    start preparing the reply before the turn is certain to be over
    RESUME          speech came back after PAUSE, before END: drop the speculation
    END             ``min_silence_ms`` of silence: the user's turn is over

:class:`TurnDetector` is the interface; :class:`SilenceTurnDetector` is the VAD-silence
policy. A smarter detector (a semantic end-of-turn model) can replace it.
"""

from __future__ import annotations

import enum
from typing import Protocol

from voicebot.config import VadConfig


class Signal(enum.Enum):
    SPEECH_START = "speech_start"
    QUIET = "quiet"
    PAUSE = "pause"
    RESUME = "resume"
    END = "end"


class TurnDetector(Protocol):
    in_speech: bool
    speech_end_ms: float | None

    def update(self, prob: float, window_ms: float, bot_speaking: bool) -> list[Signal]: ...

    def reset(self) -> None: ...


class SilenceTurnDetector:
    def __init__(self, cfg: VadConfig) -> None:
        self.cfg = cfg
        self.reset()

    def reset(self) -> None:
        self.in_speech = False  # a user turn is open
        self.paused = False  # PAUSE sent, END not yet
        self._speech_run = 0.0  # ms of consecutive speech
        self._silence_run = 0.0  # ms of consecutive silence inside a turn
        self.clock_ms = 0.0  # audio time seen so far
        self.speech_end_ms: float | None = None  # audio time the last speech window ended

    def update(self, prob: float, window_ms: float, bot_speaking: bool = False) -> list[Signal]:
        self.clock_ms += window_ms
        out: list[Signal] = []
        # Hysteresis: once in speech, a slightly lower probability still counts as speech
        # (as Silero's own iterator does), so a soft syllable does not open a pause.
        threshold = self.cfg.threshold if not self.in_speech else max(self.cfg.threshold - 0.15, 0.01)
        if prob >= threshold:
            self._speech_run += window_ms
            self._silence_run = 0.0
            self.speech_end_ms = self.clock_ms
            if not self.in_speech:
                needed = self.cfg.barge_in_min_ms if bot_speaking else self.cfg.min_speech_ms
                if self._speech_run >= needed:
                    self.in_speech = True
                    out.append(Signal.SPEECH_START)
            elif self.paused:
                self.paused = False
                out.append(Signal.RESUME)
            return out

        self._speech_run = 0.0
        if not self.in_speech:
            return out
        self._silence_run += window_ms
        if not self.paused and self._silence_run == window_ms:
            out.append(Signal.QUIET)
        if not self.paused and self._silence_run >= self.cfg.speculative_silence_ms:
            self.paused = True
            out.append(Signal.PAUSE)
        if self._silence_run >= self.cfg.min_silence_ms:
            self.in_speech = False
            self.paused = False
            self._silence_run = 0.0
            out.append(Signal.END)
        return out

    def force_end(self) -> list[Signal]:
        """End an over-long turn (``session.max_turn_s``)."""
        if not self.in_speech:
            return []
        out = [] if self.paused else [Signal.PAUSE]
        self.in_speech = False
        self.paused = False
        self.speech_end_ms = self.clock_ms
        return [*out, Signal.END]
