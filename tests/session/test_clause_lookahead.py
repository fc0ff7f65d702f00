"""A reply's clauses go to TTS as soon as they are written (``session.tts_lookahead_clauses``),
each with the seconds of audio ahead of it, and are heard in order.

The defect this guards: a reply opening with "Sure," (~0.4 s of audio) sent its next clause
to TTS only once "Sure," was synthesised, so under a shared TTS queue the caller heard a
gap after it (the GPU runs at 192-320 callers: 40-50% of replies stalled).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
from fakes import FakeLlm

from voicebot.errors import EngineError
from voicebot.session.response import SECONDS_PER_WORD, Response

RATE = 16_000


class SlowTts:
    """``delays[text]`` seconds before a clause's one chunk (100 ms of tone per word); logs
    when each clause was asked for, delivered or abandoned, and the ``ahead_s`` it came with."""

    sample_rate = RATE
    queue_depth = 0

    def __init__(self, delays: dict[str, float], fail: str | None = None) -> None:
        self.delays = delays
        self.fail = fail
        self.log: list[tuple[str, str]] = []
        self.ahead: dict[str, float] = {}

    def voices(self) -> list[str]:
        return ["fake"]

    async def synthesize(self, text: str, *, voice: str | None = None, speed: float | None = None,
                         ahead_s: float = 0.0) -> AsyncIterator[np.ndarray]:
        self.log.append(("start", text))
        self.ahead[text] = ahead_s
        done = False
        try:
            await asyncio.sleep(self.delays.get(text, 0.0))
            if text == self.fail:
                raise EngineError("synthesis failed")
            yield np.full(len(text.split()) * RATE // 10, 0.2, dtype=np.float32)
            done = True
            self.log.append(("audio", text))
        finally:
            if not done:
                self.log.append(("aborted", text))


def reply(text: str, tts: SlowTts, lookahead: int = 1) -> Response:
    llm = FakeLlm(tokenizer=None, reply=text, word_delay=0.0)
    return Response("resp_1", "item_1", [1], llm, tts, voice=None, speed=None,  # type: ignore[arg-type]
                    max_tokens=64, first_clause_words=6, max_clause_words=24, gated=False,
                    tts_lookahead=lookahead)


SURE = "Sure, I can help with that."


async def test_the_next_clause_is_synthesised_while_the_first_one_is() -> None:
    tts = SlowTts({"Sure,": 0.2, "I can help with that.": 0.05})
    resp = reply(SURE, tts)
    await resp.run()
    # Both asked for before "Sure," had its audio: the second is ready when "Sure," ends.
    assert tts.log[:2] == [("start", "Sure,"), ("start", "I can help with that.")]
    assert [text for *_, text in resp.playout.spans] == ["Sure,", "I can help with that."]


async def test_audio_goes_in_in_clause_order_when_a_later_clause_is_ready_first() -> None:
    tts = SlowTts({"Sure,": 0.2, "I can help with that.": 0.0})
    resp = reply(SURE, tts)
    await resp.run()
    assert ("audio", "I can help with that.") in tts.log[:3]  # it was ready first...
    # ...heard second, each clause's samples once
    assert resp.playout.spans == [(0, 1600, "Sure,"), (1600, 9600, "I can help with that.")]


async def test_each_clause_says_how_much_audio_is_ahead_of_it() -> None:
    tts = SlowTts({"Sure,": 0.1})
    await reply(SURE, tts).run()
    assert tts.ahead["Sure,"] == 0.0  # the caller waits for it in silence
    # Asked for while "Sure," was in synthesis: its one word is the estimate.
    assert tts.ahead["I can help with that."] == pytest.approx(SECONDS_PER_WORD)


async def test_without_lookahead_a_clause_waits_for_the_one_before() -> None:
    tts = SlowTts({"Sure,": 0.1})
    await reply(SURE, tts, lookahead=0).run()
    assert tts.log[:3] == [("start", "Sure,"), ("audio", "Sure,"), ("start", "I can help with that.")]


async def test_the_lookahead_is_bounded() -> None:
    text = "One, two, three, four, five, six, seven."
    tts = SlowTts({c: 0.05 for c in ("One,", "two,", "three,")})
    resp = Response("resp_1", "item_1", [1], FakeLlm(tokenizer=None, reply=text, word_delay=0.0),  # type: ignore[arg-type]
                    tts, voice=None, speed=None, max_tokens=64, first_clause_words=1, max_clause_words=1,
                    gated=False, tts_lookahead=1)
    await resp.run()
    in_synthesis = peak = 0
    for event, _ in tts.log:
        in_synthesis += 1 if event == "start" else -1
        peak = max(peak, in_synthesis)
    assert peak == 2  # the clause going into the playout and one ahead of it
    assert [t for *_, t in resp.playout.spans] == ["One,", "two,", "three,", "four,", "five,", "six,", "seven."]


async def test_a_later_clause_failing_is_raised_after_the_clauses_before_it() -> None:
    tts = SlowTts({"Sure,": 0.1}, fail="I can help with that.")
    resp = reply(SURE, tts)
    with pytest.raises(ExceptionGroup) as info:
        await resp.run()
    assert info.group_contains(EngineError)
    assert [text for *_, text in resp.playout.spans] == ["Sure,"]  # heard whole first


async def test_cancelling_the_reply_aborts_every_clause_in_synthesis() -> None:
    tts = SlowTts({"Sure,": 10.0, "I can help with that.": 10.0})
    task = asyncio.create_task(reply(SURE, tts).run())
    while len(tts.log) < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(tts.log[2:]) == [("aborted", "I can help with that."), ("aborted", "Sure,")]
