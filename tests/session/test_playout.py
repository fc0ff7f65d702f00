import numpy as np

from voicebot.session.playout import Playout


def tone(n: int) -> np.ndarray:
    return np.full(n, 0.1, dtype=np.float32)


def test_take_is_fifo_across_clauses() -> None:
    p = Playout(sample_rate=1000)
    p.add(tone(300))
    p.end_clause("one two three")
    p.add(tone(200))
    p.end_clause("four five")
    assert p.queued_samples == 500
    assert p.take(250).size == 250
    assert p.take(1000).size == 250
    assert p.take(10).size == 0
    assert p.heard_text() == "one two three four five"


def test_heard_text_cuts_inside_a_clause() -> None:
    p = Playout(sample_rate=1000)
    p.add(tone(400))
    p.end_clause("alpha beta gamma delta")
    p.add(tone(400))
    p.end_clause("epsilon zeta")
    p.take(600)
    # 600 samples: the first clause in full, half of the second.
    assert p.heard_text() == "alpha beta gamma delta epsilon"
    # A transport may know the caller heard less (buffered audio).
    assert p.heard_text(played_samples=200) == "alpha beta"
    assert p.heard_text(played_samples=0) == ""


def test_clear_drops_queued_audio_but_keeps_the_timeline() -> None:
    p = Playout(sample_rate=1000)
    p.add(tone(1000))
    p.end_clause("a b c d")
    p.take(500)
    assert p.clear() == 500
    assert p.queued_samples == 0
    assert p.heard_text() == "a b"


def test_room_is_bounded() -> None:
    p = Playout(sample_rate=1000, max_seconds=1.0)
    p.add(tone(999))
    assert p.has_room()
    p.add(tone(10))
    assert not p.has_room()
    p.take(100)
    assert p.has_room()


def test_a_reply_starts_with_its_first_audible_sample() -> None:
    from voicebot.session.response import trim_leading_silence

    rate = 16000
    audio = np.concatenate([np.zeros(rate // 10, np.float32), np.full(rate // 10, 0.2, np.float32)])
    trimmed = trim_leading_silence(audio, rate)
    assert trimmed.size == rate // 10 + rate // 100  # 10 ms of lead-in kept
    assert trim_leading_silence(np.zeros(100, np.float32), rate).size == 100  # all quiet: untouched
