"""Smart Turn inside a session, with fakes and virtual time: what a client that stops
sending audio at a pause gets.

The end-of-turn cap (``vad.smart_turn_max_silence_ms``) counted audio only: silence
frames received. A client that sends its question and then nothing more (Pipecat and
LiveKit fed from a WAV with one second of trailing silence) was never answered when the
model heard the turn as unfinished. The cap is wall-clock time since the last window
now, and speech that comes back moves it on.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import numpy as np
from fakes import Caller, call, elapse, make_engines, until

from voicebot.config import VadConfig
from voicebot.engines.registry import Engines
from voicebot.session import events as ev

CAP_MS = 1500


class ScriptedModel:
    """An end-of-turn model that answers each check from ``answers`` at once."""

    def __init__(self, *answers: float) -> None:
        self.answers = list(answers)
        self.asked = 0

    def submit(self, audio16k: np.ndarray) -> Future[float]:
        self.asked += 1
        fut: Future[float] = Future()
        fut.set_result(self.answers.pop(0) if self.answers else 0.1)
        return fut


def smart_vad(engines: Engines) -> VadConfig:
    return engines.cfg.vad.model_copy(
        update={"turn_detector": "smart_turn", "smart_turn_check_ms": 192, "smart_turn_max_silence_ms": CAP_MS}
    )


def ended(c: Caller) -> bool:
    return bool(c.of(ev.TranscriptFinal))


async def test_an_unfinished_turn_ends_at_the_cap_when_no_more_audio_comes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    model = ScriptedModel(0.1)  # "not finished"
    engines.turn_model = model  # type: ignore[assignment]
    async with call(engines, vad=smart_vad(engines)) as c:
        await c.speak(600)
        await c.silence(300)  # past the check: the model hears it unfinished
        assert model.asked == 1
        last_audio = c.clock.monotonic()
        # Then the client sends nothing. The turn stays open for the cap, counted from
        # the last speech (about 300 ms of silence were already heard) ...
        await elapse(c.clock, (CAP_MS - 300 - 100) / 1000)
        assert not ended(c), "ended before the cap"
        # ... and ends at it: wall time counts, not only the silence frames received.
        await until(c.clock, lambda: ended(c), timeout=1.0)
        assert c.clock.monotonic() - last_audio <= (CAP_MS - 300 + 100) / 1000
        await until(c.clock, lambda: c.of(ev.ResponseDone))


async def test_speech_after_a_gap_moves_the_cap_on(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    model = ScriptedModel(0.1, 0.1)
    engines.turn_model = model  # type: ignore[assignment]
    async with call(engines, vad=smart_vad(engines)) as c:
        await c.speak(600)
        await c.silence(300)
        await elapse(c.clock, 0.8)  # a gap with no audio, shorter than the cap
        await c.speak(600)  # the caller goes on in the same turn
        assert not ended(c) and not c.of(ev.ResponseAudioStarted)
        await c.silence(300)
        assert model.asked == 2
        # The cap counts from the second speech now, not from the first.
        await elapse(c.clock, (CAP_MS - 300 - 100) / 1000)
        assert not ended(c), "the first pause's timer ended the resumed turn"
        await until(c.clock, lambda: ended(c), timeout=1.0)
        assert len(c.of(ev.TranscriptFinal)) == 1


async def test_a_client_that_stops_before_the_check_gets_its_turn_judged(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A client streaming faster than real time may end with less trailing silence than
    the check needs: the model is asked once that much time has passed with no audio."""
    engines = make_engines(tokenizer)
    model = ScriptedModel(0.9)  # "finished"
    engines.turn_model = model  # type: ignore[assignment]
    async with call(engines, vad=smart_vad(engines)) as c:
        await c.speak(600)
        await c.silence(100)  # less than smart_turn_check_ms; then nothing
        await until(c.clock, lambda: ended(c), timeout=0.5)  # well before the cap
        assert model.asked == 1


async def test_closing_with_a_turn_timer_pending_leaves_no_task(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    engines.turn_model = ScriptedModel(0.1)  # type: ignore[assignment]
    async with call(engines, vad=smart_vad(engines)) as c:
        await c.speak(600)
        await c.silence(300)
        assert any(t.get_name().endswith("turn-timer") for t in asyncio.all_tasks())
    await c.clock.settle()  # type: ignore[attr-defined]
    assert not any(t.get_name().endswith("turn-timer") for t in asyncio.all_tasks())
