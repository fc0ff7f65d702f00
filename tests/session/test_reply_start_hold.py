"""``session.reply_start_hold_ms``: a reply whose first clause is short waits a little for
the next one before it starts, instead of playing "Sure," and then a gap.

Seen on one GPU with 256 callers whose turns end together: the shared TTS delivered the
second clause 100-200 ms after "Sure," (0.3 s) had played, in 20-27% of replies
(docs/gpu-results.md). Time is virtual, as in test_session.py; the fake TTS speaks 100 ms
a word and takes its own time per clause.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
from fakes import FakeTts, call, make_engines, with_session_cfg

from voicebot.session import events as ev
from voicebot.session.speaker import _first

SURE = "Sure, I can help with that."


class LateTts(FakeTts):
    """FakeTts whose clauses take ``delays[text]`` seconds (default: its own delay)."""

    def __init__(self, clock, delays: dict[str, float]) -> None:  # type: ignore[no-untyped-def]
        super().__init__(clock)
        self.delays = delays

    async def synthesize(self, text: str, *, voice: str | None = None, speed: float | None = None,
                         ahead_s: float = 0.0) -> AsyncIterator[np.ndarray]:
        self.delay = self.delays.get(text, 0.005)
        async for chunk in super().synthesize(text, voice=voice, speed=speed, ahead_s=ahead_s):
            yield chunk


async def frames_sent(tokenizer, reply: str, delays: dict[str, float], hold_ms: int,  # type: ignore[no-untyped-def]
                      low_water_ms: int = 1000) -> tuple[float, float]:
    """(seconds from the request to the reply's first frame, the longest gap between frames)."""
    engines = make_engines(tokenizer, reply=reply, word_delay=0.001)
    engines.tts = LateTts(engines.tts.clock, delays)  # type: ignore[attr-defined]
    with_session_cfg(engines, reply_start_hold_ms=hold_ms, clause_low_water_ms=low_water_ms)
    sent: list[float] = []
    async with call(engines, turn_detection=False) as c:
        put = c.session.outbox.put_nowait

        def timed(e: object) -> None:
            if isinstance(e, ev.ResponseAudio):
                sent.append(c.clock.monotonic())
            put(e)  # type: ignore[arg-type]

        c.session.outbox.put_nowait = timed  # type: ignore[method-assign]
        c.session.add_text("user", "Can you help?")
        asked = c.clock.monotonic()
        c.session.create_response()
        done = await c.wait_for(ev.ResponseDone, timeout=30)
    assert done.status == "completed" and sent
    return sent[0] - asked, max(b - a for a, b in zip(sent, sent[1:], strict=False))


async def test_without_a_hold_a_late_second_clause_is_a_gap_after_the_first(tokenizer) -> None:  # type: ignore[no-untyped-def]
    start, gap = await frames_sent(tokenizer, SURE, {"I can help with that.": 0.25}, hold_ms=0)
    assert start < 0.05
    assert gap > 0.1  # "Sure," is 0.1 s: the second clause came ~0.15 s after it had played


async def test_a_hold_starts_the_reply_once_its_next_clause_is_there_and_plays_it_whole(tokenizer) -> None:  # type: ignore[no-untyped-def]
    start, gap = await frames_sent(tokenizer, SURE, {"I can help with that.": 0.25}, hold_ms=400)
    assert 0.2 < start < 0.3  # started when the second clause came, not at the hold's end
    assert gap < 0.03  # one 20 ms frame after another


async def test_the_hold_is_the_longest_a_reply_waits(tokenizer) -> None:  # type: ignore[no-untyped-def]
    late = {"I can help with that.": 1.0}  # later than any hold
    start, gap = await frames_sent(tokenizer, SURE, late, hold_ms=0)
    held_start, held_gap = await frames_sent(tokenizer, SURE, late, hold_ms=100)
    assert abs(held_start - start - 0.1) < 0.01  # its first audio, then the 100 ms hold
    assert abs(gap - held_gap - 0.1) < 0.01  # the gap stays, shorter by the hold


async def test_a_reply_that_is_all_there_starts_at_once(tokenizer) -> None:  # type: ignore[no-untyped-def]
    start, _ = await frames_sent(tokenizer, "Sure thing.", {}, hold_ms=1000)
    assert start < 0.05  # nothing more is coming: no reason to wait


async def test_a_first_clause_as_long_as_the_low_water_is_not_held(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # "Sure," is 0.1 s of the fake's audio: enough once clause_low_water_ms is 100.
    start, gap = await frames_sent(tokenizer, SURE, {"I can help with that.": 0.25}, hold_ms=400, low_water_ms=100)
    assert start < 0.05 and gap > 0.1



async def test_an_error_in_the_holds_wait_is_raised_not_lost() -> None:
    """The hold waits for the first of two events (speaker._first): an error in either is
    the caller's, not a "Task exception was never retrieved" at exit."""
    async def broken_clock() -> None:
        raise RuntimeError("the clock broke")

    woken = asyncio.Event()
    with pytest.raises(RuntimeError, match="the clock broke"):
        await _first(woken.wait(), broken_clock())
    woken.set()
    await _first(woken.wait(), asyncio.sleep(60))  # the first to end wins; the sleep is cancelled
