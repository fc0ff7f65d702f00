"""End-of-turn and barge-in decisions from VAD probabilities (and, optionally, meaning).

A plain synchronous state machine fed one VAD window at a time, so it can be tested
without audio or clocks. It speaks in signals; the session decides what they mean.

    SPEECH_START    speech lasted ``min_speech_ms`` (``barge_in_min_ms`` while the bot
                    talks, so a cough does not cut the reply off)
    QUIET           the first silent window after speech: decode what was said now, so
                    the transcript is ready by the time the pause is long enough
    PAUSE           ``speculative_silence_ms`` of silence after speech: a good moment to
                    start preparing the reply before the turn is certain to be over
    RESUME          speech came back after PAUSE, before END: drop the speculation
    END             the user's turn is over

:class:`TurnDetector` is the interface. :class:`SilenceTurnDetector` ends the turn after
``min_silence_ms`` of silence. :class:`SemanticTurnDetector` also hears *what* was said:
at ``smart_turn_check_ms`` of silence it asks an end-of-turn model (Smart Turn v3,
:mod:`voicebot.engines.smart_turn`) whether the turn sounds finished, on its own thread;
the turn ends as soon as the answer is yes, and only after
``smart_turn_max_silence_ms`` when it is no. That cap is wall-clock time since the
last speech: time with no audio at all counts as silence toward it (:meth:`poll` with
``idle_ms``, driven by the session's timer), so a client that stops sending after its
question is still answered. A caller reading out a list with pauses
between items is then not cut off at each pause, and one who has clearly finished
is answered sooner than the silence rule allows. The session is unchanged by the
choice: PAUSE still starts the speculative reply, which END releases.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from voicebot.audio import ASR_RATE
from voicebot.config import VadConfig
from voicebot.core.turn_policy import Decision, PauseHistory, TurnPolicyConfig, decide

log = logging.getLogger(__name__)

# Audio before the detected onset that the end-of-turn model also hears: speech starts
# before the VAD is sure of it (Pipecat feeds Smart Turn 500 ms of it too).
PRE_SPEECH_MS = 500
# The model reads the last 8 s of a turn.
MODEL_WINDOW_S = 8


class Signal(enum.Enum):
    SPEECH_START = "speech_start"
    QUIET = "quiet"
    PAUSE = "pause"
    RESUME = "resume"
    END = "end"


class TurnDetector(Protocol):
    cfg: VadConfig
    in_speech: bool
    paused: bool
    speech_end_ms: float | None
    turn_start_ms: float | None

    def feed(self, audio16k: np.ndarray) -> None:
        """The audio the next windows' probabilities are computed from (16 kHz)."""

    def update(self, prob: float, window_ms: float, bot_speaking: bool = False) -> list[Signal]: ...

    def force_end(self) -> list[Signal]: ...

    def expect_words(self) -> int: ...

    def hear_words(self, token: int, text: str) -> None: ...

    def hear_partial(self, text: str) -> None: ...

    @property
    def pending(self) -> Future[float] | None: ...

    def poll(self, idle_ms: float = 0.0) -> list[Signal]: ...

    def idle_deadline_ms(self) -> float | None: ...

    def reset(self) -> None: ...

    def forget_turn_end(self) -> None:
        """The turn that ended last was no turn (a backchannel or a noise over a reply):
        speech soon after it is not a caller going on after a pause."""


class EndOfTurnModel(Protocol):
    """What :class:`SemanticTurnDetector` needs of a model (a fake in unit tests)."""

    def submit(self, audio16k: np.ndarray) -> Future[float]:
        """P(the turn is finished) for a turn's audio ending now, computed off the caller's thread."""
        ...


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
        self.turn_start_ms: float | None = None  # audio time the open turn's speech began

    def feed(self, audio16k: np.ndarray) -> None:
        """Silence alone decides: the audio itself is not needed."""

    def forget_turn_end(self) -> None:
        """No history of pauses to keep it out of."""

    def update(self, prob: float, window_ms: float, bot_speaking: bool = False) -> list[Signal]:
        self.clock_ms += window_ms
        out: list[Signal] = []
        # Hysteresis, as Silero's own iterator does it: in speech, a slightly lower
        # probability still counts as speech, so a soft syllable does not open a pause;
        # once silence has begun, only the full threshold ends it. A breath after the
        # last word (0.3-0.5) then neither drops the prepared reply (RESUME) nor counts as
        # speech the final must hear, which the session's ASR mark never did.
        soft = self.in_speech and self._silence_run == 0.0
        threshold = max(self.cfg.threshold - 0.15, 0.01) if soft else self.cfg.threshold
        if prob >= threshold:
            self._speech_run += window_ms
            self._silence_run = 0.0
            self.speech_end_ms = self.clock_ms
            if not self.in_speech:
                needed = self.cfg.barge_in_min_ms if bot_speaking else self.cfg.min_speech_ms
                if self._speech_run >= needed:
                    self.in_speech = True
                    self.turn_start_ms = self.clock_ms - self._speech_run
                    out.append(Signal.SPEECH_START)
            else:
                self._speaking_again()
                if self.paused:
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
        if self._turn_over(self._silence_run):
            self._close_turn()
            out.append(Signal.END)
        return out

    def expect_words(self) -> int:
        """This pause's transcript is being decoded (silence alone does not read it)."""
        return 0

    def hear_words(self, token: int, text: str) -> None:
        """The transcript of the pause ``token``, for a detector that weighs words."""

    def hear_partial(self, text: str) -> None:
        """The open turn's latest partial transcript."""

    def _turn_over(self, silence_ms: float) -> bool:
        """Is ``silence_ms`` of silence after speech the end of the turn?"""
        return silence_ms >= self.cfg.min_silence_ms

    def _speaking_again(self) -> None:
        """Speech inside an open turn: any pause so far was not its end."""

    def _close_turn(self) -> None:
        self.in_speech = False
        self.paused = False
        self._silence_run = 0.0
        self._speaking_again()

    @property
    def pending(self) -> Future[float] | None:
        """A verdict asked for and not yet read (semantic detectors only)."""
        return None

    def poll(self, idle_ms: float = 0.0) -> list[Signal]:
        """Between audio windows, ``idle_ms`` after the last one: END (after PAUSE, if
        that was not sent) if the open turn is over although no audio came: a verdict
        that came after the last window, or, for the semantic cap, time (a client may
        send nothing more after its question, or send it slowly)."""
        if not self.in_speech or not self._over_when_idle(max(0.0, idle_ms)):
            return []
        out = [] if self.paused else [Signal.PAUSE]
        self._close_turn()
        return [*out, Signal.END]

    def _over_when_idle(self, idle_ms: float) -> bool:
        """The silence rule is judged on audio only, as OpenAI's server VAD: a stall on
        the wire is not a pause."""
        return self.paused and self._turn_over(self._silence_run)

    def idle_deadline_ms(self) -> float | None:
        """Time with no audio after the last window at which :meth:`poll` may end the
        open turn or ask the model; None when only audio (or a verdict) can."""
        return None

    def force_end(self) -> list[Signal]:
        """End an over-long turn (``session.max_turn_s``)."""
        if not self.in_speech:
            return []
        out = [] if self.paused else [Signal.PAUSE]
        self._close_turn()
        self.speech_end_ms = self.clock_ms
        return [*out, Signal.END]


class SemanticTurnDetector(SilenceTurnDetector):
    """Silence plus an end-of-turn model; follows ``cfg.turn_detector`` at every pause,
    so a session may switch between 'silence' and 'smart_turn' mid-call."""

    def __init__(self, cfg: VadConfig, model: EndOfTurnModel) -> None:
        self.model = model
        self._audio: deque[np.ndarray] = deque()
        # How this caller pauses: kept for the whole call, across turns.
        self.history = PauseHistory()
        self.partial_words = ""  # the open turn's last partial transcript
        self._ended_at_ms: float | None = None  # audio time the last turn was ended
        self._silence_at_end = 0.0
        super().__init__(cfg)

    def reset(self) -> None:
        super().reset()
        self._audio.clear()
        self._audio_samples = 0  # in the deque
        self._fed = 0  # samples fed since reset: the same time axis as clock_ms
        self._pending: Future[float] | None = None  # asked at this pause, no answer yet
        self.verdict: float | None = None  # the model's answer for this pause
        self._failed = False  # the model failed at this pause: silence decides
        self.checks = 0  # model calls since reset (for tests and logs)
        self.words: str | None = None  # this pause's own transcript, once decoded
        self._awaiting_words = 0  # the pause whose transcript is being decoded (0: none)
        self._pause_seq = 0
        self.decision: Decision | None = None  # the policy's answer at this pause
        self._last_silence = 0.0  # the silence run before the window being judged

    @property
    def pending(self) -> Future[float] | None:
        return self._pending

    def feed(self, audio16k: np.ndarray) -> None:
        audio = np.asarray(audio16k, dtype=np.float32).reshape(-1)
        if audio.size == 0:
            return
        self._audio.append(audio)
        self._audio_samples += audio.size
        self._fed += audio.size
        # The model reads 8 s at most: keep that plus the pre-speech margin.
        keep = (MODEL_WINDOW_S * 1000 + PRE_SPEECH_MS) * ASR_RATE // 1000
        while self._audio_samples - self._audio[0].size >= keep:
            self._audio_samples -= self._audio.popleft().size

    def _turn_audio(self) -> np.ndarray:
        """The open turn from shortly before its onset to now (the last 8 s of it)."""
        if not self._audio or self.turn_start_ms is None:
            return np.zeros(0, dtype=np.float32)
        start = int((self.turn_start_ms - PRE_SPEECH_MS) * ASR_RATE / 1000)
        first = self._fed - self._audio_samples  # sample index of the deque's head
        audio = np.concatenate(self._audio)[max(0, start - first) :]
        return audio[-MODEL_WINDOW_S * ASR_RATE :]

    # ---------------------------------------------------------- words and history
    def expect_words(self) -> int:
        """This pause's transcript is being decoded: the policy may wait for it. Returns
        the token :meth:`hear_words` is answered with."""
        self._awaiting_words = self._pause_seq
        return self._pause_seq

    def hear_words(self, token: int, text: str) -> None:
        """The transcript of the pause ``token`` (ignored once the caller went on)."""
        if token == self._pause_seq and self._awaiting_words == token and self.in_speech:
            self.words = text
            self._awaiting_words = 0

    def hear_partial(self, text: str) -> None:
        if self.in_speech:
            self.partial_words = text

    def _policy(self) -> TurnPolicyConfig:
        cfg = self.cfg
        return TurnPolicyConfig(cfg.smart_turn_check_ms, cfg.smart_turn_max_silence_ms, cfg.smart_turn_threshold,
                                words=cfg.smart_turn_words, history=cfg.smart_turn_history)

    def _decide(self) -> Decision:
        final = self.words is not None
        words = self.words if final else (None if self._awaiting_words else self.partial_words)
        self.decision = decide(self._policy(), verdict=self.verdict, words=words, history=self.history, final=final)
        return self.decision

    def update(self, prob: float, window_ms: float, bot_speaking: bool = False) -> list[Signal]:
        was_open = self.in_speech
        self._last_silence = self._silence_run
        out = super().update(prob, window_ms, bot_speaking)
        if Signal.SPEECH_START in out and not was_open and self._ended_at_ms is not None:
            # The caller spoke again soon after a turn we ended: that pause was not its end.
            gap = (self.turn_start_ms or self.clock_ms) - self._ended_at_ms
            judged = self._silence_at_end < self.cfg.smart_turn_max_silence_ms  # not ended by the cap
            if judged and gap < self.cfg.smart_turn_max_silence_ms:
                self.history.went_on_after(self._silence_at_end + max(0.0, gap))
            self._ended_at_ms = None
        return out

    def forget_turn_end(self) -> None:
        self._ended_at_ms = None

    def _close_turn(self) -> None:
        self._ended_at_ms, self._silence_at_end = self.clock_ms, self._silence_run
        if log.isEnabledFor(logging.DEBUG):
            why = self.decision.reason if self.decision is not None else "silence cap or no verdict"
            log.debug("turn over after %.0f ms of silence: %s (words %r)", self._silence_run, why,
                      self.words if self.words is not None else self.partial_words)
        self.partial_words = ""
        super()._close_turn()

    def _turn_over(self, silence_ms: float) -> bool:
        cfg = self.cfg
        if cfg.turn_detector != "smart_turn" or self._failed:
            return super()._turn_over(silence_ms)
        if silence_ms >= cfg.smart_turn_max_silence_ms:
            return True
        if self.verdict is None and self._pending is None and silence_ms >= cfg.smart_turn_check_ms:
            audio = self._turn_audio()
            if audio.size == 0:  # nothing to judge (no audio was fed): silence decides
                self._failed = True
                return super()._turn_over(silence_ms)
            self.checks += 1
            self._pending = self.model.submit(audio)
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            try:
                self.verdict = pending.result()
            except Exception as exc:  # a broken model must not hold the turn open
                log.warning("end-of-turn model failed, silence decides this pause: %s", exc)
                self._failed = True
                return super()._turn_over(silence_ms)
        if self.verdict is None:
            return False
        return silence_ms >= self._decide().silence_ms

    def _over_when_idle(self, idle_ms: float) -> bool:
        """Time with no audio counts as silence toward the cap, so a turn heard as
        unfinished still ends when the client sends nothing more; and, once a pause has
        begun, toward the check (a client that streamed its question faster than real
        time may end it with less trailing silence than the check needs)."""
        cfg = self.cfg
        if cfg.turn_detector != "smart_turn" or self._failed:
            return super()._over_when_idle(idle_ms)
        silence = self._silence_run + idle_ms
        if silence >= cfg.smart_turn_max_silence_ms:
            return True
        if self._silence_run == 0:
            return False  # the last window was speech: no pause to judge yet
        over = self._turn_over(silence)
        if self._failed:  # the model failed just now: silence decides, on audio
            return super()._over_when_idle(idle_ms)
        return over

    def idle_deadline_ms(self) -> float | None:
        cfg = self.cfg
        if not self.in_speech or cfg.turn_detector != "smart_turn" or self._failed:
            return None
        cap = cfg.smart_turn_max_silence_ms - self._silence_run
        if self._silence_run > 0 and self.verdict is None and self._pending is None:
            cap = min(cap, cfg.smart_turn_check_ms - self._silence_run)
        if self._silence_run > 0 and self.verdict is not None:
            cap = min(cap, self._decide().silence_ms - self._silence_run)  # the policy's wait
        return max(0.0, cap)

    def _speaking_again(self) -> None:
        if self._pending is not None:
            self._pending.cancel()  # not started yet: never run; running: result ignored
            self._pending = None
        verdict, decision = self.verdict, self.decision
        if verdict is not None and verdict >= self.cfg.smart_turn_threshold and self.in_speech:
            # The pause sounded like the end of the turn and was not (whatever held it
            # here: the words, or waiting for them): this caller pauses this long.
            self.history.went_on_after(self._last_silence)
            log.debug("caller went on after %.0f ms (%s)", self._last_silence,
                      decision.reason if decision is not None else "finished verdict")
        self.verdict = None
        self._failed = False
        self.words = None
        self._awaiting_words = 0
        self._pause_seq += 1
        self.decision = None


def make_turn_detector(cfg: VadConfig, model: EndOfTurnModel | None) -> TurnDetector:
    """The session's detector: semantic when the server loaded an end-of-turn model
    (``vad.turn_detector: smart_turn`` at start-up), else silence only."""
    if model is None:
        if cfg.turn_detector == "smart_turn":
            log.warning("vad.turn_detector is smart_turn but no end-of-turn model is loaded: silence decides")
        return SilenceTurnDetector(cfg)
    return SemanticTurnDetector(cfg, model)
