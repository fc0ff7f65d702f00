"""Turn detection: the silence rule and the semantic (Smart Turn) detector, with fakes."""

from concurrent.futures import Future

import numpy as np
import pytest

from voicebot.config import VadConfig
from voicebot.session.turns import (
    SemanticTurnDetector,
    Signal,
    SilenceTurnDetector,
    TurnDetector,
    make_turn_detector,
)

W = 32.0  # ms per VAD window


def run(det: SilenceTurnDetector, probs: list[float], bot_speaking: bool = False) -> list[tuple[int, Signal]]:
    out = []
    for i, p in enumerate(probs):
        out.extend((i, s) for s in det.update(p, W, bot_speaking))
    return out


def cfg(**kw: int) -> VadConfig:
    base = dict(min_speech_ms=96, min_silence_ms=320, speculative_silence_ms=128, barge_in_min_ms=192)
    base.update(kw)
    return VadConfig(**base)


def test_turn_start_pause_end() -> None:
    det = SilenceTurnDetector(cfg())
    signals = run(det, [0.9] * 10 + [0.05] * 12)
    kinds = [s for _, s in signals]
    assert kinds == [Signal.SPEECH_START, Signal.QUIET, Signal.PAUSE, Signal.END]
    idx = {s: i for i, s in signals}
    assert idx[Signal.SPEECH_START] == 2  # 3 windows = 96 ms of speech
    assert idx[Signal.QUIET] == 10  # the first silent window
    assert idx[Signal.PAUSE] == 10 + 3  # 4 windows = 128 ms of silence
    assert idx[Signal.END] == 10 + 9  # 10 windows = 320 ms of silence


def test_short_noise_is_not_a_turn() -> None:
    det = SilenceTurnDetector(cfg())
    assert run(det, [0.9, 0.9, 0.1, 0.9, 0.1] * 4) == []


def test_resume_after_pause_cancels_speculation() -> None:
    det = SilenceTurnDetector(cfg())
    kinds = [s for _, s in run(det, [0.9] * 5 + [0.1] * 5 + [0.9] * 3 + [0.1] * 11)]
    assert kinds == [
        Signal.SPEECH_START, Signal.QUIET, Signal.PAUSE, Signal.RESUME, Signal.QUIET, Signal.PAUSE, Signal.END
    ]


def test_barge_in_needs_longer_speech_while_bot_speaks() -> None:
    det = SilenceTurnDetector(cfg())
    # 160 ms of speech over the bot: below barge_in_min_ms (192): no interruption.
    assert run(det, [0.9] * 5 + [0.1] * 3, bot_speaking=True) == []
    det.reset()
    signals = run(det, [0.9] * 6, bot_speaking=True)
    assert signals == [(5, Signal.SPEECH_START)]


def test_hysteresis_keeps_soft_syllables_in_speech() -> None:
    det = SilenceTurnDetector(cfg(threshold=0.5))
    # 0.4 is below the onset threshold but above threshold - 0.15 once speaking.
    kinds = [s for _, s in run(det, [0.9] * 4 + [0.4] * 20)]
    assert kinds == [Signal.SPEECH_START]


def test_once_silence_began_only_the_full_threshold_is_speech_again() -> None:
    # As Silero's own iterator: a breath after the last word (0.4, between the in-speech
    # hysteresis and the threshold) neither resumes the turn after its pause (RESUME
    # dropped the prepared reply) nor moves the end of speech; the session's ASR mark,
    # on the full threshold, never counted it (review of 5bf316a).
    det = SilenceTurnDetector(cfg(min_silence_ms=640))
    signals = run(det, [0.9] * 4 + [0.05] * 5 + [0.4] * 3 + [0.05] * 20)
    kinds = [s for _, s in signals]
    assert kinds == [Signal.SPEECH_START, Signal.QUIET, Signal.PAUSE, Signal.END], kinds
    assert det.speech_end_ms == 4 * W
    # Real speech after the pause still resumes it.
    det = SilenceTurnDetector(cfg(min_silence_ms=640))
    kinds = [s for _, s in run(det, [0.9] * 4 + [0.05] * 5 + [0.9] * 3)]
    assert kinds == [Signal.SPEECH_START, Signal.QUIET, Signal.PAUSE, Signal.RESUME], kinds


def test_force_end_closes_an_open_turn() -> None:
    det = SilenceTurnDetector(cfg())
    run(det, [0.9] * 5)
    assert det.force_end() == [Signal.PAUSE, Signal.END]
    assert det.force_end() == []


# ------------------------------------------------------------ semantic end of turn
SAMPLES = 512  # one 32 ms window at 16 kHz


class FakeModel:
    """Scripted end-of-turn model: answers from ``answers`` at once, or leaves the
    future pending (``hold=True``) for the test to resolve."""

    def __init__(self, *answers: float | Exception, hold: bool = False) -> None:
        self.answers = list(answers)
        self.hold = hold
        self.seen: list[np.ndarray] = []
        self.futures: list[Future[float]] = []

    def submit(self, audio16k: np.ndarray) -> Future[float]:
        self.seen.append(audio16k)
        fut: Future[float] = Future()
        self.futures.append(fut)
        if not self.hold:
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                fut.set_exception(answer)
            else:
                fut.set_result(answer)
        return fut


def smart(**kw: object) -> VadConfig:
    base: dict[str, object] = dict(
        min_speech_ms=96, min_silence_ms=320, speculative_silence_ms=128, barge_in_min_ms=192,
        turn_detector="smart_turn", smart_turn_check_ms=192, smart_turn_max_silence_ms=960,
    )
    base.update(kw)
    return VadConfig(**base)  # type: ignore[arg-type]


def feed_run(det: TurnDetector, probs: list[float], start: int = 0) -> list[tuple[int, Signal]]:
    """Feed one window of audio (its sample indices as values) per probability."""
    out = []
    for i, p in enumerate(probs, start):
        det.feed(np.arange(i * SAMPLES, (i + 1) * SAMPLES, dtype=np.float32))
        out.extend((i, s) for s in det.update(p, W))
    return out


def test_confident_model_ends_the_turn_before_the_silence_rule() -> None:
    model = FakeModel(0.9)
    det = SemanticTurnDetector(smart(), model)
    signals = feed_run(det, [0.9] * 10 + [0.05] * 12)
    assert [s for _, s in signals] == [Signal.SPEECH_START, Signal.QUIET, Signal.PAUSE, Signal.END]
    # Asked at 192 ms of silence (6 windows), answered at once: END there, not at 320 ms.
    assert dict((s, i) for i, s in signals)[Signal.END] == 10 + 5
    assert det.checks == 1 and not det.in_speech


def test_unfinished_turn_is_held_open_up_to_the_cap() -> None:
    det = SemanticTurnDetector(smart(), FakeModel(0.1))
    signals = feed_run(det, [0.9] * 10 + [0.05] * 40)
    # The silence rule would end it at 320 ms; the model's "not finished" holds it to 960 ms.
    assert [s for _, s in signals] == [Signal.SPEECH_START, Signal.QUIET, Signal.PAUSE, Signal.END]
    assert dict((s, i) for i, s in signals)[Signal.END] == 10 + 29  # 30 windows = 960 ms


def test_speech_after_an_unfinished_pause_resumes_and_is_judged_again() -> None:
    model = FakeModel(0.1, 0.8)
    det = SemanticTurnDetector(smart(), model)
    # 600 ms pause (> min_silence_ms, < cap): the same turn goes on; the second pause ends it.
    signals = feed_run(det, [0.9] * 10 + [0.05] * 19 + [0.9] * 10 + [0.05] * 10)
    kinds = [s for _, s in signals]
    assert kinds == [Signal.SPEECH_START, Signal.QUIET, Signal.PAUSE, Signal.RESUME,
                     Signal.QUIET, Signal.PAUSE, Signal.END]
    assert det.checks == 2
    # The second check hears the whole turn so far, pause included.
    assert model.seen[1].size > model.seen[0].size + 25 * SAMPLES


def test_turn_waits_for_a_slow_verdict_and_ends_when_it_comes() -> None:
    model = FakeModel(hold=True)
    det = SemanticTurnDetector(smart(), model)
    signals = feed_run(det, [0.9] * 10 + [0.05] * 14)
    assert [s for _, s in signals] == [Signal.SPEECH_START, Signal.QUIET, Signal.PAUSE]
    model.futures[0].set_result(0.7)
    assert det.update(0.05, W) == [Signal.END]


def test_a_verdict_after_the_last_window_is_read_by_poll() -> None:
    model = FakeModel(hold=True)
    det = SemanticTurnDetector(smart(), model)
    feed_run(det, [0.9] * 10 + [0.05] * 8)  # asked at 192 ms; then no more audio
    assert det.pending is model.futures[0] and det.poll() == []
    model.futures[0].set_result(0.2)  # unfinished: the pause stays open
    assert det.poll() == [] and det.in_speech
    det.update(0.9, W)  # the caller goes on; the next pause is asked again
    feed_run(det, [0.05] * 8, start=19)
    model.futures[1].set_result(0.9)
    assert det.poll() == [Signal.END] and not det.in_speech
    assert det.poll() == []


def test_a_verdict_that_never_comes_ends_at_the_cap() -> None:
    det = SemanticTurnDetector(smart(), FakeModel(hold=True))
    signals = feed_run(det, [0.9] * 10 + [0.05] * 40)
    assert dict((s, i) for i, s in signals)[Signal.END] == 10 + 29


def test_resume_cancels_a_pending_verdict() -> None:
    model = FakeModel(hold=True)
    det = SemanticTurnDetector(smart(), model)
    feed_run(det, [0.9] * 10 + [0.05] * 7 + [0.9])
    assert model.futures[0].cancelled()
    model.futures[0] = Future()  # a late answer of the old pause must not end the turn
    assert det.verdict is None and det.in_speech


def test_a_failing_model_falls_back_to_silence() -> None:
    det = SemanticTurnDetector(smart(), FakeModel(RuntimeError("onnx broke")))
    signals = feed_run(det, [0.9] * 10 + [0.05] * 12)
    assert dict((s, i) for i, s in signals)[Signal.END] == 10 + 9  # min_silence_ms, as VAD only


def test_silence_mode_never_asks_the_model() -> None:
    model = FakeModel()
    det = SemanticTurnDetector(smart(turn_detector="silence"), model)
    signals = feed_run(det, [0.9] * 10 + [0.05] * 12)
    assert dict((s, i) for i, s in signals)[Signal.END] == 10 + 9
    assert model.seen == []


def test_model_hears_the_turn_from_half_a_second_before_onset_and_at_most_8_s() -> None:
    model = FakeModel(0.9, 0.9)
    det = SemanticTurnDetector(smart(), model)
    # 1 s of silence, 1 s of speech, then the pause: onset detected at window 31+2.
    feed_run(det, [0.05] * 31 + [0.9] * 31 + [0.05] * 6)
    audio = model.seen[0]
    onset = 31 * SAMPLES
    assert audio[0] == onset - 8000  # 500 ms of pre-speech
    assert audio[-1] == 68 * SAMPLES - 1  # up to the latest sample fed
    # A turn of 10 s: only its last 8 s.
    det.reset()
    feed_run(det, [0.9] * 320 + [0.05] * 6)
    assert model.seen[1].size == 8 * 16000 and model.seen[1][-1] == 326 * SAMPLES - 1


def test_factory_picks_semantic_only_with_a_model() -> None:
    assert isinstance(make_turn_detector(smart(), None), SilenceTurnDetector)
    assert not isinstance(make_turn_detector(smart(), None), SemanticTurnDetector)
    assert isinstance(make_turn_detector(smart(), FakeModel()), SemanticTurnDetector)


def test_check_must_come_before_the_cap() -> None:
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="smart_turn_check_ms"):
        smart(smart_turn_check_ms=960)


# ------------------------------------------- time with no audio (the client stopped)
def test_idle_time_ends_an_unfinished_turn_at_the_cap() -> None:
    """The cap counted silence frames only: a client that sends nothing after its
    question, heard as unfinished, was never answered. Time with no audio counts now."""
    det = SemanticTurnDetector(smart(), FakeModel(0.1))
    feed_run(det, [0.9] * 10 + [0.05] * 8)  # 256 ms of silence heard, the model says "not finished"
    assert det.checks == 1 and det.poll() == []
    assert det.poll(idle_ms=960 - 256 - 1) == [] and det.in_speech
    assert det.poll(idle_ms=960 - 256) == [Signal.END] and not det.in_speech
    assert det.poll(idle_ms=5000) == []


def test_idle_time_asks_the_model_once_a_pause_has_begun() -> None:
    model = FakeModel(0.9)
    det = SemanticTurnDetector(smart(), model)
    feed_run(det, [0.9] * 10 + [0.05] * 2)  # 64 ms of silence, less than the check's 192
    assert det.poll(idle_ms=100) == [] and det.checks == 0
    # Asked at 192 ms of silence and no audio; "finished" ends the turn.
    assert det.poll(idle_ms=128) == [Signal.PAUSE, Signal.END] and model.seen


def test_idle_time_during_speech_ends_the_turn_at_the_cap_only() -> None:
    model = FakeModel(0.9)
    det = SemanticTurnDetector(smart(), model)
    feed_run(det, [0.9] * 10)  # the last window was speech: no pause to judge
    assert det.poll(idle_ms=900) == [] and det.checks == 0
    assert det.poll(idle_ms=960) == [Signal.PAUSE, Signal.END]


def test_speech_after_idle_time_starts_the_count_again() -> None:
    det = SemanticTurnDetector(smart(), FakeModel(0.1, 0.1))
    feed_run(det, [0.9] * 10 + [0.05] * 8)
    assert det.poll(idle_ms=600) == []  # a gap, then the caller goes on
    feed_run(det, [0.9] * 5 + [0.05] * 8, start=18)
    assert det.poll(idle_ms=600) == [] and det.in_speech  # 256 + 600 < 960: the old gap is gone
    assert det.poll(idle_ms=704) == [Signal.END]


def test_silence_mode_is_judged_on_audio_only() -> None:
    """The silence rule is audio time, as OpenAI's server VAD: a stall on the wire is not
    a pause. (Only the semantic cap also counts time with no audio.)"""
    det = SilenceTurnDetector(cfg())
    run(det, [0.9] * 10 + [0.05] * 5)
    assert det.poll(idle_ms=5000) == [] and det.in_speech
    assert det.idle_deadline_ms() is None


# ------------------------------------------------ the policy's words and history
def end_index(signals: list[tuple[int, Signal]]) -> int | None:
    return dict((s, i) for i, s in signals).get(Signal.END)


def test_open_words_hold_a_turn_the_model_hears_as_finished() -> None:
    det = SemanticTurnDetector(smart(), FakeModel(0.9))
    signals = feed_run(det, [0.9] * 10 + [0.05] * 5)  # PAUSE at window 13
    assert Signal.PAUSE in [s for _, s in signals]
    token = det.expect_words()  # the session decodes the pause's transcript
    det.hear_words(token, "I'd like a table for two and")
    signals = feed_run(det, [0.05] * 30, start=15)
    # Held to the cap (960 ms: 30 windows of silence), not ended at the check.
    assert end_index(signals) == 10 + 29


def test_a_finished_verdict_waits_for_the_pause_transcript_then_ends() -> None:
    det = SemanticTurnDetector(smart(), FakeModel(0.9))
    feed_run(det, [0.9] * 10 + [0.05] * 5)
    token = det.expect_words()
    signals = feed_run(det, [0.05] * 5, start=15)
    assert end_index(signals) is None  # finished audio, words still being decoded
    det.hear_words(token, "What time do you open on Sundays?")
    assert [s for s in det.poll(0.0)] == [Signal.END]


def test_words_of_a_pause_the_caller_went_on_after_are_not_read_at_the_next() -> None:
    det = SemanticTurnDetector(smart(), FakeModel(0.1, 0.9))
    feed_run(det, [0.9] * 10 + [0.05] * 5)
    stale = det.expect_words()
    feed_run(det, [0.9] * 10 + [0.05] * 5, start=15)  # went on: RESUME, then a new pause
    det.hear_words(stale, "I'd like a table for two and")  # the first pause's: ignored
    assert det.words is None


def test_a_caller_who_went_on_after_an_end_of_turn_is_waited_for_longer_next_time() -> None:
    det = SemanticTurnDetector(smart(), FakeModel(0.9, 0.9, 0.9))
    first = feed_run(det, [0.9] * 10 + [0.05] * 8)
    assert end_index(first) == 15  # ended at the check
    # ... but the caller goes on 320 ms into the silence: that pause was not the end.
    feed_run(det, [0.05] * 2 + [0.9] * 10, start=18)
    assert det.history.longest_ms == pytest.approx(320.0)
    # At the next pause a finished verdict waits past 320 ms (+150): 15 windows.
    signals = feed_run(det, [0.05] * 20, start=30)
    assert end_index(signals) == 30 + 14


def test_speech_soon_after_a_forgotten_turn_is_not_a_caller_going_on() -> None:
    # A backchannel over the reply ended as a turn and was then judged no turn (the
    # session forgets it): the caller speaking again 320 ms later is not a pause they
    # went on after, and the next turn is not held longer for it.
    det = SemanticTurnDetector(smart(), FakeModel(0.9, 0.9, 0.9))
    first = feed_run(det, [0.9] * 10 + [0.05] * 8)
    assert end_index(first) == 15
    det.forget_turn_end()
    feed_run(det, [0.05] * 2 + [0.9] * 10, start=18)
    assert det.history.longest_ms is None
    signals = feed_run(det, [0.05] * 20, start=30)
    assert end_index(signals) == 30 + 5  # ended at the check, as the first


def test_a_pause_that_sounded_finished_is_remembered_even_while_its_words_held_it() -> None:
    # "And so my fellow Americans" [1 s] "ask not ...": the verdict said finished, the
    # turn waited for the pause's words, and the caller went on before they came. At
    # the next such pause this caller is waited for past that pause.
    det = SemanticTurnDetector(smart(), FakeModel(0.9, 0.9))
    feed_run(det, [0.9] * 10 + [0.05] * 5)  # PAUSE: the session decodes its words
    det.expect_words()
    signals = feed_run(det, [0.05] * 5 + [0.9] * 10, start=15)  # went on before they came
    assert end_index(signals) is None and det.decision is None
    assert det.history.longest_ms == pytest.approx(320.0)


def test_a_pause_that_sounded_unfinished_is_not_remembered() -> None:
    det = SemanticTurnDetector(smart(), FakeModel(0.1, 0.9))
    feed_run(det, [0.9] * 10 + [0.05] * 8)
    feed_run(det, [0.05] * 2 + [0.9] * 10, start=18)
    assert det.history.longest_ms is None


# Silero's probabilities (32 ms windows) for the JFK clip from 0.22 s to 5.72 s:
# "And so my fellow Americans" (speech to ~2.2 s), a breath at ~3.36 s and ~4.05 s, then
# "ask not ..." from ~5.41 s. Probabilities of the clip, rounded: no audio is kept here.
JFK_OPENING_PAUSE = [float(p) for p in """
0.14 0.12 0.09 0.60 0.78 0.77 0.74 0.72 0.77 0.84 0.86 0.86 0.79 0.71 0.81 0.89 0.88 0.86 0.83 0.83 0.80
0.80 0.78 0.78 0.83 0.85 0.85 0.84 0.76 0.76 0.76 0.82 0.86 0.83 0.73 0.72 0.84 0.83 0.85 0.83 0.81 0.80
0.79 0.79 0.77 0.81 0.85 0.87 0.88 0.86 0.86 0.86 0.83 0.81 0.81 0.86 0.87 0.73 0.82 0.78 0.64 0.54 0.38
0.28 0.20 0.15 0.13 0.08 0.07 0.08 0.07 0.06 0.06 0.07 0.05 0.04 0.04 0.04 0.03 0.03 0.03 0.03 0.03 0.04
0.03 0.02 0.02 0.02 0.02 0.02 0.02 0.03 0.02 0.03 0.03 0.11 0.43 0.40 0.57 0.43 0.26 0.16 0.14 0.11 0.08
0.11 0.28 0.24 0.37 0.24 0.18 0.14 0.12 0.08 0.04 0.03 0.02 0.18 0.33 0.62 0.66 0.56 0.33 0.34 0.33 0.24
0.26 0.32 0.22 0.13 0.09 0.07 0.04 0.04 0.02 0.02 0.01 0.01 0.01 0.01 0.01 0.00 0.00 0.00 0.00 0.00 0.00
0.01 0.00 0.00 0.00 0.00 0.00 0.00 0.00 0.00 0.00 0.00 0.00 0.00 0.01 0.01 0.63 0.87 0.88 0.89 0.90 0.90
0.89 0.87 0.92 0.94""".split()]


def test_an_opening_that_sounds_finished_holds_the_turn_through_the_speakers_pause() -> None:
    # Smart Turn hears "And so my fellow Americans" as finished (0.98) and the recogniser
    # punctuates it as a sentence, but it is only an opening: the turn is held, and
    # the breaths in the pause say the caller is still there until "ask not ...".
    det = SemanticTurnDetector(smart(smart_turn_max_silence_ms=1500), FakeModel(0.98, 0.13, 0.01, 0.01))
    signals: list[tuple[int, Signal]] = []
    for i, p in enumerate(JFK_OPENING_PAUSE):
        det.feed(np.zeros(SAMPLES, dtype=np.float32))
        got = det.update(p, W)
        if Signal.PAUSE in got:
            det.hear_words(det.expect_words(), "And so my fellow Americans.")
        signals.extend((i, s) for s in got)
    kinds = [s for _, s in signals]
    assert Signal.END not in kinds, signals
    assert kinds[-1] is Signal.RESUME and signals[-1][0] == len(JFK_OPENING_PAUSE) - 10
    assert det.history.longest_ms is not None  # the pause sounded finished: remembered
