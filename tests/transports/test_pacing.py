"""The wire pacer on a clock the test moves: exact schedules, no timing on busy cores.

The end-to-end Twilio test checks that a real reply is not sent in one burst; how
frames are spread (the lead, no catch-up after a stall, the restart when idle) is
decided here, where the clock is the test's.
"""

from __future__ import annotations

import pytest

from voicebot.transports.pacing import Pacer

FRAME = 0.02
LEAD = 0.04


def send_all(pacer: Pacer, arrivals: list[float]) -> list[float]:
    """When each frame leaves, for frames handed over at ``arrivals`` (in order)."""
    now, sent = 0.0, []
    for arrived in arrivals:
        now = max(now, arrived)
        now += pacer.delay(now)
        pacer.sent()
        sent.append(now)
    return sent


def test_a_burst_leaves_in_real_time_after_the_lead() -> None:
    # A whole second of reply handed over at once (the call's own lead, a late block).
    sent = send_all(Pacer(LEAD), [1.0] * 50)
    # The first lead's worth goes at once, then one frame per 20 ms.
    assert sent[:3] == [1.0, 1.0, 1.0]
    assert sent[3:] == pytest.approx([1.0 + k * FRAME - LEAD for k in range(3, 50)])
    # Never more than the lead ahead of the frames' real-time schedule.
    assert all(t >= 1.0 + k * FRAME - LEAD - 1e-9 for k, t in enumerate(sent))


def test_frames_arriving_in_real_time_are_not_delayed() -> None:
    arrivals = [2.0 + k * FRAME for k in range(20)]
    assert send_all(Pacer(LEAD), arrivals) == pytest.approx(arrivals)


def test_after_a_stall_the_clock_restarts_instead_of_catching_up() -> None:
    # 10 frames in real time, then the TTS falls 300 ms behind and hands over 10 at once.
    arrivals = [k * FRAME for k in range(10)] + [0.5] * 10
    sent = send_all(Pacer(LEAD), arrivals)
    late = sent[10:]
    # No burst to make up the 300 ms: real time again from the late frame, with the lead.
    assert late[:3] == [0.5, 0.5, 0.5]
    assert late[3:] == pytest.approx([0.5 + k * FRAME - LEAD for k in range(3, 10)])


def test_an_idle_gap_restarts_the_schedule() -> None:
    pacer = Pacer(LEAD)
    send_all(pacer, [0.0] * 5)
    # The next reply, seconds later, starts its own schedule at once.
    assert pacer.delay(5.0) == 0.0


def test_reset_forgets_the_schedule() -> None:
    # A `clear` drops what was queued: the next reply does not inherit the old base.
    pacer = Pacer(LEAD)
    send_all(pacer, [0.0] * 40)  # scheduled up to ~0.74 s
    pacer.reset()
    assert pacer.delay(0.1) == 0.0
