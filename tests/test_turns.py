from voicebot.config import VadConfig
from voicebot.session.turns import Signal, SilenceTurnDetector

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


def test_force_end_closes_an_open_turn() -> None:
    det = SilenceTurnDetector(cfg())
    run(det, [0.9] * 5)
    assert det.force_end() == [Signal.PAUSE, Signal.END]
    assert det.force_end() == []
