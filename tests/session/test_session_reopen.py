"""A pause taken for the end of the turn, in a whole call with fakes on a virtual clock:
when the caller goes on before a word of the reply is heard, the reply is withdrawn
unseen and the turn goes on as one utterance, with one transcript and one user item."""

from __future__ import annotations

from fakes import Caller, call, make_engines

from voicebot.engines.registry import Engines
from voicebot.session import events as ev
from voicebot.transports.realtime_session import RealtimeTranslator

WHOLE = "what is the weather like in Paris"


def kinds(c: Caller) -> list[str]:
    return [type(e).__name__ for e in c.events
            if not isinstance(e, ev.ResponseAudio | ev.TranscriptPartial | ev.ResponseTextDelta | ev.TurnTimings)]


async def goes_on_before_the_reply_is_heard(c: Caller, engines: Engines) -> None:
    await c.speak(600)
    await c.silence(600)  # the turn ends at 480 ms; its reply is written, not yet spoken
    reply = c.session.core.reply
    assert reply is not None and reply.released and not reply.shown, "released, no audio out yet"
    assert kinds(c) == ["SpeechStarted"], "the client hears of the end of the turn with its reply"
    engines.asr.text = WHOLE  # type: ignore[attr-defined]
    await c.speak(500)
    await c.silence(600)
    await c.wait_for(ev.ResponseDone, timeout=20)


async def test_speech_before_the_reply_is_heard_goes_on_as_one_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The reply's first clause (six words) is 1.2 s away: the caller goes on before it.
    engines = make_engines(tokenizer, word_delay=0.2)
    async with call(engines) as c:
        await goes_on_before_the_reply_is_heard(c, engines)
        assert kinds(c)[:4] == ["SpeechStarted", "SpeechStopped", "TranscriptFinal", "ResponseStarted"]
        assert [f.text for f in c.of(ev.TranscriptFinal)] == [WHOLE], "one transcript"
        assert len(c.of(ev.SpeechStarted)) == 1 and len(c.of(ev.SpeechStopped)) == 1
        assert not c.of(ev.BargeIn)
        assert [d.status for d in c.of(ev.ResponseDone)] == ["completed"] and len(c.of(ev.ResponseStarted)) == 1
        history = [(m.role, m.content) for m in c.session.conversation.messages]
        assert history == [("user", WHOLE), ("assistant", engines.llm.reply)]  # type: ignore[attr-defined]
        assert len(engines.llm.started) == 2 and len(engines.llm.aborted) == 1, "the withdrawn reply was aborted"  # type: ignore[attr-defined]
        assert engines.asr.final_audio_s[-1] >= 1.1, "the last final decoded both stretches of speech"  # type: ignore[attr-defined]


async def test_realtime_sees_one_user_item_and_nothing_of_the_withdrawn_reply(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.2)
    async with call(engines) as c:
        tr = RealtimeTranslator(c.session, session_id=c.session.id, model="m", beta=False)  # type: ignore[arg-type]
        await goes_on_before_the_reply_is_heard(c, engines)
        rendered = [e for event in list(c.events) for e in tr.session_event(event)]  # type: ignore[arg-type]
    types = [e["type"] for e in rendered if e["type"] != "response.output_audio.delta"]
    for once in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed",
                 "response.created", "response.done"):
        assert types.count(once) == 1, (once, types)
    users = [e["item"]["id"] for e in rendered if e["type"] == "conversation.item.added" and e["item"]["role"] == "user"]
    done = next(e for e in rendered if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert len(users) == 1 and done["item_id"] == users[0] and done["transcript"] == WHOLE
    assert next(e for e in rendered if e["type"] == "response.done")["response"]["status"] == "completed"
