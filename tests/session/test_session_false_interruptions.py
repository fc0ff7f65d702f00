"""False interruptions in a whole call, with fakes on a virtual clock: speech over the
reply pauses its audio; a backchannel or a noise resumes it from where it stopped, with
nothing on the wire; words make it a barge-in, reported as one."""

from __future__ import annotations

import numpy as np
from fakes import RATE, Caller, call, make_engines, until

from voicebot.engines.registry import Engines
from voicebot.session import events as ev
from voicebot.transports.realtime_session import RealtimeTranslator

WORD = RATE // 10  # the fake TTS speaks 100 ms a word


def audio_of(c: Caller, rid: str) -> np.ndarray:
    return np.concatenate([e.audio for e in c.of(ev.ResponseAudio) if e.response_id == rid])


async def reply_playing(c: Caller) -> str:
    """The caller asks; the reply's audio starts."""
    await c.speak(600)
    await c.silence(500)
    started = await c.wait_for(ev.ResponseAudioStarted)
    return started.response_id  # type: ignore[no-any-return]


def kinds(c: Caller) -> list[str]:
    return [type(e).__name__ for e in c.events if not isinstance(e, ev.ResponseAudio | ev.TranscriptPartial)]


async def test_a_backchannel_pauses_the_reply_and_it_resumes_where_it_stopped(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    async with call(engines) as c:
        rid = await reply_playing(c)
        engines.asr.text = "Mm-hmm."  # type: ignore[attr-defined]
        await c.speak(300)
        paused_at = len(c.of(ev.ResponseAudio))
        await c.silence(400)  # short of the end of that turn: still being judged
        assert len(c.of(ev.ResponseAudio)) == paused_at, "no reply audio while the caller speaks"
        await c.silence(300)
        done = await c.wait_for(ev.ResponseDone, timeout=10)
        assert done.status == "completed" and done.response_id == rid
        assert len(c.of(ev.ResponseAudio)) > paused_at, "it went on"
        full = engines.llm.reply.split()  # type: ignore[attr-defined]
        assert audio_of(c, rid).size == len(full) * WORD, "every word once: nothing dropped or repeated"
        assert not c.of(ev.BargeIn)
        assert len(c.of(ev.SpeechStarted)) == 1 and len(c.of(ev.SpeechStopped)) == 1, "no new turn"
        assert [f.text for f in c.of(ev.TranscriptFinal)] == ["what is the weather like"]
        history = c.session.conversation.messages
        assert [(m.role, m.content) for m in history] == [("user", "what is the weather like"),
                                                          ("assistant", engines.llm.reply)]  # type: ignore[attr-defined]
        assert len(engines.llm.started) == 1, "no reply to the backchannel"  # type: ignore[attr-defined]


async def test_a_noise_resumes_the_reply(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    async with call(engines) as c:
        await reply_playing(c)
        engines.asr.text = ""  # type: ignore[attr-defined]
        await c.speak(260)
        await c.silence(700)
        done = await c.wait_for(ev.ResponseDone, timeout=10)
        assert done.status == "completed" and not c.of(ev.BargeIn)
        assert len(c.of(ev.SpeechStarted)) == 1


async def test_words_over_the_reply_are_a_barge_in_that_keeps_what_was_heard(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    async with call(engines) as c:
        rid = await reply_playing(c)
        await c.silence(400)  # four words heard
        await c.speak(300)
        assert not c.of(ev.BargeIn), "not yet known to be a turn"
        sent = audio_of(c, rid).size
        c.session.listener.asr.hear("Wait, stop")  # type: ignore[attr-defined]
        barge = await c.wait_for(ev.BargeIn)
        full = engines.llm.reply.split()  # type: ignore[attr-defined]
        heard = barge.heard_text.split()
        assert heard == full[: len(heard)] and abs(len(heard) - sent / WORD) <= 1.01, (heard, sent / WORD)
        assert audio_of(c, rid).size == sent, "nothing more of it was sent"
        order = kinds(c)
        assert order.count("SpeechStarted") == 2
        cut = order.index("BargeIn")
        assert order[cut:cut + 3] == ["BargeIn", "ResponseDone", "SpeechStarted"], \
            "the cut reply, then the speech that cut it: as a barge-in that cut at once"
        done = c.of(ev.ResponseDone)[0]
        assert done.status == "interrupted" and done.text == barge.heard_text
        engines.asr.text = "Wait, stop, what about tomorrow?"  # type: ignore[attr-defined]
        await c.silence(700)
        await until(c.clock, lambda: len(c.of(ev.ResponseDone)) == 2, timeout=10)
        history = [(m.role, m.content) for m in c.session.conversation.messages]
        assert history[:3] == [("user", "what is the weather like"), ("assistant", barge.heard_text),
                               ("user", "Wait, stop, what about tomorrow?")]


async def test_words_only_in_the_final_transcript_cut_the_reply_then_answer_them(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    async with call(engines) as c:
        await reply_playing(c)
        engines.asr.text = "Stop."  # type: ignore[attr-defined]
        await c.speak(300)
        await c.silence(700)
        await until(c.clock, lambda: len(c.of(ev.ResponseDone)) == 2, timeout=10)
        barge = c.of(ev.BargeIn)[0]
        order = kinds(c)
        cut = order.index("BargeIn")
        assert order[cut:cut + 5] == ["BargeIn", "ResponseDone", "SpeechStarted", "SpeechStopped",
                                      "TranscriptFinal"]
        history = [(m.role, m.content) for m in c.session.conversation.messages]
        assert history[:3] == [("user", "what is the weather like"), ("assistant", barge.heard_text),
                               ("user", "Stop.")]
        assert [d.status for d in c.of(ev.ResponseDone)] == ["interrupted", "completed"]


async def test_off_speech_cuts_the_reply_at_once(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    vad = engines.cfg.vad.model_copy(update={"resume_false_interruption": False})
    async with call(engines, vad=vad) as c:
        await reply_playing(c)
        engines.asr.text = "Mm-hmm."  # type: ignore[attr-defined]
        await c.speak(260)
        assert c.of(ev.BargeIn), "cut by speech alone"


# ----------------------------------------------------------- on the Realtime wire
async def realtime_events(engines: Engines, script) -> list[list[dict]]:  # type: ignore[no-untyped-def]
    """What the Realtime translator sends for each of the call's events, in order."""
    async with call(engines) as c:
        tr = RealtimeTranslator(c.session, session_id=c.session.id, model="m", beta=False)  # type: ignore[arg-type]
        await script(c)
        events = list(c.events)
    return [tr.session_event(event) for event in events]  # type: ignore[arg-type]


def types_of(rendered: list[list[dict]]) -> list[str]:
    return [e["type"] for out in rendered for e in out if e["type"] != "response.output_audio.delta"]


async def test_realtime_sees_nothing_of_a_resumed_reply_and_one_response_done(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)

    async def script(c: Caller) -> None:
        await reply_playing(c)
        engines.asr.text = "okay"  # type: ignore[attr-defined]
        await c.speak(300)
        await c.silence(700)
        await c.wait_for(ev.ResponseDone, timeout=10)

    types = types_of(await realtime_events(engines, script))
    assert types.count("input_audio_buffer.speech_started") == 1
    assert types.count("response.done") == 1 and types.count("response.created") == 1


async def test_realtime_reports_a_barge_in_speech_first_and_at_once(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)

    async def script(c: Caller) -> None:
        await reply_playing(c)
        await c.speak(300)
        c.session.listener.asr.hear("Hold on")  # type: ignore[attr-defined]
        await c.wait_for(ev.BargeIn)

    rendered = await realtime_events(engines, script)
    types = types_of(rendered)
    second = [i for i, t in enumerate(types) if t == "input_audio_buffer.speech_started"][1]
    assert types[second + 1:].count("response.done") == 1 and "response.done" not in types[:second], \
        "the cancelled reply is reported after the speech that cut it"
    with_speech = next(out for out in rendered[::-1] if any(e["type"] == "input_audio_buffer.speech_started"
                                                            for e in out))
    assert with_speech[-1]["type"] == "response.done", "sent with the speech, not held for a later event"
    assert with_speech[-1]["response"]["status"] == "cancelled"
