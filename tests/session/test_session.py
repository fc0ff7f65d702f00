"""Session logic with fakes of our own engine interfaces: timing-exact and fast.

The real engines are exercised end to end in test_voice_loop.py; here the question is
the state machine: speculation and its cancellation, barge-in and what the history
keeps, manual turns, failures and bounded output.

Time is virtual (:class:`VirtualClock`): the fakes' delays, the caller's 20 ms audio
frames and the session's pacer all run on it, so the tests are exact on a loaded
machine and take no wall-clock time to speak or wait.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fakes import (
    FRAME,
    LONG_INSTRUCTIONS,
    RATE,
    Caller,
    call,
    clock_of,
    elapse,
    make_engines,
    until,
    with_session_cfg,
)

from voicebot.engines.registry import Engines
from voicebot.errors import BadAudio, BadMessage
from voicebot.metrics import Metrics
from voicebot.session import events as ev
from voicebot.session.clock import REAL_CLOCK, Clock
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings


async def test_the_conversation_is_prefilled_when_the_call_starts_and_after_each_reply(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # A long system prompt (a Realtime client's instructions) was prefilled with the
    # first turn, seconds on a CPU; a reply's last blocks were cached only as far as
    # the model computed them. Both are prefilled while nobody waits on the LLM.
    engines = make_engines(tokenizer, reply="Sure, the room is free.")
    llm = engines.llm
    async with call(engines, system_prompt=LONG_INSTRUCTIONS) as c:
        await until(c.clock, lambda: llm.warmed)  # type: ignore[attr-defined]
        start = c.session.conversation.history_ids()
        assert llm.warmed == [start] and len(start) > 16  # type: ignore[attr-defined]
        await c.speak(600)
        await c.silence(700)
        await c.wait_for(ev.ResponseDone, timeout=10)
        await until(c.clock, lambda: len(llm.warmed) == 2)  # type: ignore[attr-defined]
        after = llm.warmed[1]  # type: ignore[attr-defined]
        assert after == c.session.conversation.history_ids() and after[: len(start)] == start
        assert len(llm.started) == 1, "one reply; the prefills are not replies"
        await c.silence(500)
        assert len(llm.warmed) == 2, "nothing new: no second prefill of the same history"  # type: ignore[attr-defined]


async def test_a_prefill_still_running_when_a_reply_starts_is_dropped(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, warm_delay=30.0)
    llm = engines.llm
    async with call(engines, system_prompt=LONG_INSTRUCTIONS) as c:
        await c.speak(600)
        await c.silence(700)
        await c.wait_for(ev.ResponseAudioStarted, timeout=10)
        assert llm.warms_cancelled == 1 and not llm.warmed  # type: ignore[attr-defined]


async def test_no_prefill_when_warm_prefix_is_off(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    engines.cfg = engines.cfg.model_copy(update={"llm": engines.cfg.llm.model_copy(update={"warm_prefix": False})})
    async with call(engines, system_prompt=LONG_INSTRUCTIONS) as c:
        await c.speak(600)
        await c.silence(700)
        await c.wait_for(ev.ResponseDone, timeout=10)
        await c.silence(500)
        assert not engines.llm.warmed  # type: ignore[attr-defined]


async def test_a_turn_is_answered_speculatively(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    async with call(engines) as c:
        await c.speak(600)
        await c.silence(700)
        done = await c.wait_for(ev.ResponseDone, timeout=10)
        assert done.status == "completed"
        assert engines.asr.finals == 1, "one decode: the speculative final is the final"
        assert engines.asr.partial_requests >= 1, "a decode was asked for as soon as the caller went quiet"
        timings = c.of(ev.TurnTimings)[0]
        assert timings.speculative is True
        kinds = [type(e).__name__ for e in c.events if not isinstance(e, ev.ResponseAudio)]
        assert kinds.index("SpeechStopped") < kinds.index("ResponseStarted"), "nothing is said before the turn ends"
        assert kinds.index("TranscriptFinal") < kinds.index("ResponseAudioStarted")
        history = c.session.conversation.messages
        assert [m.role for m in history] == ["user", "assistant"]
        assert history[1].content == engines.llm.reply


async def test_resuming_speech_cancels_the_speculation(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.05)
    async with call(engines) as c:
        await c.speak(600)
        await c.silence(300)  # past the speculative point, short of the end of turn
        assert engines.llm.started, "the reply was being prepared"
        await c.speak(400)  # the caller goes on
        assert engines.llm.aborted == engines.llm.started[:1], "the speculative vLLM request was aborted"
        assert not c.of(ev.ResponseStarted) and not c.of(ev.SpeechStopped)
        await c.silence(800)
        done = await c.wait_for(ev.ResponseDone, timeout=10)
        assert done.status == "completed"
        assert len(c.of(ev.SpeechStarted)) == 1 and len(c.of(ev.ResponseDone)) == 1


async def test_barge_in_stops_playout_and_history_keeps_the_played_words(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    async with call(engines) as c:
        await c.speak(600)
        await c.silence(500)
        await c.wait_for(ev.ResponseAudioStarted)
        await c.pause(0.6)  # about six words (100 ms each) played
        t0 = c.clock.monotonic()
        await c.speak(260)  # pauses the reply
        c.session.listener.asr.hear("Hold on")  # type: ignore[attr-defined]  # words: a barge-in
        barge = await c.wait_for(ev.BargeIn)
        assert c.clock.monotonic() - t0 < 0.5
        frames_at_barge = len(c.of(ev.ResponseAudio))
        await c.pause(0.2)
        assert len(c.of(ev.ResponseAudio)) == frames_at_barge, "playout stopped"
        done = c.of(ev.ResponseDone)[0]
        full = engines.llm.reply.split()
        heard = barge.heard_text.split()
        assert done.status == "interrupted" and done.text == barge.heard_text
        assert 3 <= len(heard) < len(full) and heard == full[: len(heard)]
        played_words = sum(e.audio.size for e in c.of(ev.ResponseAudio)) / (RATE / 10)
        assert abs(len(heard) - played_words) <= 1.01, (heard, played_words)
        assistant = [m for m in c.session.conversation.messages if m.role == "assistant"]
        assert [m.content for m in assistant] == [barge.heard_text]


async def test_speech_before_the_reply_is_heard_stops_it_without_a_barge_in(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The turn ended at a pause, but the caller went on before any reply audio was
    # sent: the reply is dropped unheard, so the client gets no barge-in event. With
    # vad.withdraw_unheard_reply off the client was told of both (by default it hears
    # of neither and the turn goes on: test_session_reopen.py).
    engines = make_engines(tokenizer, word_delay=0.5)
    vad = engines.cfg.vad.model_copy(update={"withdraw_unheard_reply": False})
    async with call(engines, vad=vad) as c:
        await c.speak(600)
        await c.silence(500)
        await c.wait_for(ev.ResponseStarted)
        assert not c.of(ev.ResponseAudio)
        await c.speak(300)
        c.session.listener.asr.hear("and for two people")  # type: ignore[attr-defined]
        done = await c.wait_for(ev.ResponseDone)
        assert done.status == "interrupted" and done.played_ms == 0 and done.text == ""
        assert not c.of(ev.BargeIn) and not c.of(ev.ResponseAudio)


async def test_short_noise_does_not_interrupt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    async with call(engines) as c:
        await c.speak(600)
        await c.silence(500)
        await c.wait_for(ev.ResponseAudioStarted)
        await c.speak(100)  # a cough: below barge_in_min_ms
        await c.silence(200)
        assert not c.of(ev.BargeIn)
        done = await c.wait_for(ev.ResponseDone, timeout=10)
        assert done.status == "completed"


async def test_manual_turns_without_server_vad(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    async with call(engines, turn_detection=False, create_response=False) as c:
        await c.speak(500)
        assert not c.of(ev.SpeechStarted), "no VAD events in manual mode"
        item = c.session.commit_input()
        final = await c.wait_for(ev.TranscriptFinal)
        assert final.item_id == item and final.text == engines.asr.text
        await c.pause(0.1)
        assert not c.of(ev.ResponseStarted), "no reply until the client asks"
        rid = c.session.create_response()
        done = await c.wait_for(ev.ResponseDone)
        assert done.response_id == rid and done.status == "completed"


async def test_cancel_and_truncate(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    async with call(engines, turn_detection=False) as c:
        c.session.add_text("user", "Tell me about the weather.")
        c.session.create_response()
        await c.wait_for(ev.ResponseAudioStarted)
        await c.pause(0.5)
        assert c.session.replying
        assert c.session.cancel_response()
        assert not c.session.replying
        done = await c.wait_for(ev.ResponseDone)
        assert done.status == "cancelled" and done.text
        # The client heard only 200 ms of it (2 words), and says so.
        assert c.session.truncate(done.item_id, 200) == " ".join(engines.llm.reply.split()[:2])
        assistant = [m for m in c.session.conversation.messages if m.role == "assistant"]
        assert [m.content for m in assistant] == ["It is"]


async def test_an_engine_failure_is_an_error_event_and_the_session_goes_on(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, fail=True)
    async with call(engines) as c:
        await c.speak(600)
        await c.silence(700)
        err = await c.wait_for(ev.ErrorEvent)
        assert err.code == "engine_error" and not err.fatal
        assert (await c.wait_for(ev.ResponseDone)).status == "failed"
        engines.llm.fail = False
        await c.speak(600)
        await c.silence(700)
        await until(c.clock, lambda: len(c.of(ev.ResponseDone)) >= 2)
        assert c.of(ev.ResponseDone)[1].status == "completed"


async def test_unknown_voice_is_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    with pytest.raises(BadMessage) as info:
        Session(engines, SessionSettings.from_config(engines.cfg).model_copy(update={"voice": "/etc/passwd"}))
    assert info.value.code == "invalid_voice"


async def test_a_client_that_stops_reading_is_dropped_not_buffered(tokenizer, caplog) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    with_session_cfg(engines, out_queue_frames=16)
    clock = clock_of(engines)
    session = Session(engines, SessionSettings.from_config(engines.cfg), clock=clock)
    async with session:
        for _ in range(3):  # nobody reads events
            if session.closing:
                break
            for _ in range(40):
                session.push_audio(np.full(FRAME, 0.1, dtype=np.float32), RATE)
            for _ in range(40):
                session.push_audio(np.zeros(FRAME, dtype=np.float32), RATE)
            await elapse(clock, 0.5)  # its reply's audio starts: the next speech is no longer its turn
        await until(clock, lambda: session.closed_reason is not None)
        assert session.closed_reason == "slow_consumer"
        assert session.outbox.qsize() <= 16
        # Said once: under load the GPU profile logged it ~35 times per dropped session.
        for _ in range(50):
            session.emit(ev.ErrorEvent(code="x", message="x"))
    warned = [r for r in caplog.records if "not reading events" in r.getMessage()]
    assert len(warned) == 1, len(warned)


async def test_a_long_speculative_reply_released_at_once_does_not_read_as_a_stalled_client(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # A speculative reply generates while the turn is still open; its text deltas wait
    # for the end of turn. Released, that backlog (hundreds of tokens when the model's
    # pieces hold few spaces, so clauses are long) went into the bounded outbox one
    # event per token in one loop turn: full, and the call was closed as a client that
    # stopped reading (a CI run of test_scale_out failed so). A reader that keeps up
    # must get the whole text, in order, and keep its call.
    reply = " ".join(f"w{i}" for i in range(400))
    engines = make_engines(tokenizer, reply=reply, word_delay=0.0005)
    with_session_cfg(engines, out_queue_frames=64)
    engines.cfg = engines.cfg.model_copy(update={"llm": engines.cfg.llm.model_copy(update={"max_tokens": 512})})
    async with call(engines) as c:
        await c.speak(600)
        await c.silence(700)
        done = await c.wait_for(ev.ResponseDone, timeout=60)
        assert c.session.closed_reason is None
        assert done.status == "completed", done
        deltas = c.of(ev.ResponseTextDelta)
        assert "".join(d.text for d in deltas) == reply
        assert len(deltas) < 400, "the released backlog went out in fewer events than tokens"


def slow_reader_session(tokenizer, *, word_delay: float, out_queue_frames: int) -> Session:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, reply=" ".join(f"w{i}" for i in range(80)), word_delay=word_delay)
    with_session_cfg(engines, out_queue_frames=out_queue_frames)
    return Session(engines, SessionSettings.from_config(engines.cfg), clock=clock_of(engines))


async def reply_to_a_reader_that_stopped(session: Session) -> None:
    """A turn, then 1.5 s in which nobody reads: the reply's audio waits for room."""
    for level, ms in ((0.1, 600), (0.0, 600)):
        for _ in range(ms // 20):
            session.push_audio(np.full(FRAME, level, dtype=np.float32), RATE)
            await elapse(session.clock, 0.02)
    await elapse(session.clock, 1.5)


async def test_no_text_of_a_reply_follows_its_response_done(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The client is slow: the reply's audio fills the outbox and its text waits for room.
    # A barge-in then ends the reply (ResponseDone) and frees the room its audio held:
    # the text forwarder, cancelled only later, sent what it held after the ResponseDone.
    session = slow_reader_session(tokenizer, word_delay=0.05, out_queue_frames=30)
    async with session:
        await reply_to_a_reader_that_stopped(session)
        resp = session.speaker.live
        assert resp is not None and not session.outbox.data_room() and not resp.deltas.empty(), "text is waiting for room"
        for _ in range(12):  # the caller speaks over it
            session.push_audio(np.full(FRAME, 0.1, dtype=np.float32), RATE)
        session.listener.asr.hear("Hold on")  # type: ignore[attr-defined]  # words: a barge-in
        for _ in range(20):
            await asyncio.sleep(0)
        seen = drain(session)
        done = next(i for i, e in enumerate(seen) if isinstance(e, ev.ResponseDone))
        late = [e for e in seen[done + 1 :] if isinstance(e, ev.ResponseTextDelta) and e.response_id == resp.id]
        assert session.closed_reason is None
        assert not late, late


async def test_a_reader_slow_for_a_moment_keeps_its_call_when_a_control_event_comes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The reply's audio waits for room in the outbox; it filled every place, so the next
    # control event (here a DTMF digit; a transcript or an error alike) found the queue
    # full and the call was closed as a stalled client, though the client only paused.
    session = slow_reader_session(tokenizer, word_delay=0.01, out_queue_frames=32)
    clock = session.clock
    async with session:
        await reply_to_a_reader_that_stopped(session)
        assert session.speaker.live is not None and not session.outbox.data_room()
        for digit in "123":
            session.emit(ev.Dtmf(digit))
        assert session.closed_reason is None
        seen = drain(session)  # the client reads again
        assert [e.digit for e in seen if isinstance(e, ev.Dtmf)] == ["1", "2", "3"]
        await until(clock, lambda: any(isinstance(e, ev.ResponseDone) for e in drain(session)), timeout=30)
        assert session.closed_reason is None
        # A client that stopped reading still fills the reserved places and is closed.
        for _ in range(session.outbox.maxsize + 1):
            session.emit(ev.Dtmf("9"))
        assert session.closed_reason == "slow_consumer"


async def test_speech_over_a_reply_it_does_not_interrupt_leaves_the_reply_whole(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # interrupt_response off: the pause in the caller's speech started a speculative
    # reply in the playing reply's place; that one then never ended (no ResponseDone)
    # and never reached the history.
    engines = make_engines(tokenizer, reply=" ".join(f"w{i}" for i in range(60)), word_delay=0.02)
    async with call(engines, interrupt_response=False) as c:
        await c.speak(600)
        await c.silence(700)
        first = await c.wait_for(ev.ResponseAudioStarted, timeout=10)
        await c.speak(600)  # over the reply
        await c.silence(800)
        await until(c.clock, lambda: c.of(ev.ResponseDone), timeout=10)  # 6 s of reply audio in all
        done = [d for d in c.of(ev.ResponseDone) if d.response_id == first.response_id]
        assert [d.status for d in done] == ["completed"], done
        assistant = [m.content for m in c.session.conversation.messages if m.role == "assistant"]
        assert engines.llm.reply in assistant
        finals = c.of(ev.TranscriptFinal)
        assert len(finals) == 2, "the second turn is transcribed all the same"


async def test_a_silent_wire_ends_the_session(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    with_session_cfg(engines, idle_timeout_s=1.0)
    async with call(engines) as c:
        await c.speak(100)
        t0 = c.clock.monotonic()
        err = await c.wait_for(ev.ErrorEvent, timeout=5)
        assert err.code == "idle_timeout" and err.fatal
        assert 0.95 <= c.clock.monotonic() - t0 <= 1.05, "on time, to the virtual 10 ms"
        await until(c.clock, lambda: c.session.closed_reason is not None, timeout=2)
        assert c.session.closed_reason == "idle_timeout"


async def test_a_failed_transcript_is_reported_and_the_call_goes_on(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    engines.asr.fail = True
    async with call(engines) as c:
        await c.speak(600)
        await c.silence(700)
        err = await c.wait_for(ev.ErrorEvent)
        assert err.code == "engine_error" and not err.fatal
        assert not c.of(ev.ResponseStarted), "nothing heard, nothing answered"
        engines.asr.fail = False
        await c.speak(600)
        await c.silence(700)
        done = await c.wait_for(ev.ResponseDone, timeout=10)
        assert done.status == "completed"


async def test_old_turns_are_summarised_in_the_background(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, clock=REAL_CLOCK, word_delay=0.0)
    with_session_cfg(engines, history_tokens=220)
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        for i in range(6):
            c.session.add_text("user", f"Question number {i} about the weather in some faraway town?")
            c.session.add_text("assistant", f"Answer number {i}: it will be sunny and warm there.")
        await until(c.clock, lambda: c.session.conversation.summary is not None)
        conv = c.session.conversation
        assert conv.token_count + conv.reply_tokens <= conv.budget_tokens
        # The first written is of the turns dropped (at a budget this small the history is
        # near it again once the summary is in, and a compaction may follow at once).
        assert "Question number 0" in engines.llm.summary_prompts[0] and conv.summary.startswith("Summary ")
        assert conv.messages[-1].content.startswith("Answer number 5")


# --------------------------------------------------------------- issue 8: teardown
def active_sessions(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("voicebot_active_sessions", {"transport": "native"})


@pytest.mark.parametrize("ending", ["idle_timeout", "slow_consumer", "fatal_error"])
async def test_a_session_that_ends_itself_is_torn_down_once(tokenizer, ending: str) -> None:  # type: ignore[no-untyped-def]
    """aclose() skipped its teardown when the session had ended itself: the ASR stream
    stayed open and the active-sessions gauge never went down."""
    engines = make_engines(tokenizer)
    with_session_cfg(engines, idle_timeout_s=1.0, out_queue_frames=8)
    clock = clock_of(engines)
    metrics = Metrics()
    session = Session(engines, SessionSettings.from_config(engines.cfg), metrics=metrics, clock=clock)
    async with session:
        assert active_sessions(metrics) == 1
        if ending == "slow_consumer":
            for _ in range(9):  # nobody reads events
                session.emit(ev.Dtmf("1"))
        elif ending == "fatal_error":
            session.error("engine_dead", "the engine died", fatal=True)
        await until(clock, lambda: session.ended)
        assert session.closed_reason == ending.replace("fatal_error", "engine_dead")
        # Torn down as it ended, before anyone calls aclose().
        assert engines.asr.closed == 1 and active_sessions(metrics) == 0
        await session.aclose()
    await session.aclose()
    assert engines.asr.closed == 1 and active_sessions(metrics) == 0, "exactly once"


async def test_token_counters_take_usage_known_only_at_the_end(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The prompt/cached token counters were fed at first audio: a remote reply's usage
    arrives with its last chunk, so they counted 0 for it."""
    engines = make_engines(tokenizer)
    engines.llm.usage_at_end = (300, 256)  # type: ignore[attr-defined]
    clock = clock_of(engines)
    metrics = Metrics()
    session = Session(engines, SessionSettings.from_config(engines.cfg), metrics=metrics, clock=clock)
    async with session:
        caller = Caller(session, clock)
        try:
            await caller.speak(600)
            await caller.silence(700)
            await until(clock, lambda: len(caller.of(ev.ResponseDone)) >= 1)
        finally:
            await caller.close()
    assert caller.of(ev.ResponseDone)[0].status == "completed"
    done = caller.of(ev.ResponseDone)[0]
    assert (done.input_tokens, done.cached_tokens) == (300, 256)
    # turn.timings goes out at the first audio, before the counts exist: null, not 0
    timings = caller.of(ev.TurnTimings)[0]
    assert (timings.prompt_tokens, timings.cached_prompt_tokens) == (None, None)
    assert metrics.registry.get_sample_value("voicebot_llm_prompt_tokens_total") == 300
    assert metrics.registry.get_sample_value("voicebot_llm_cached_prompt_tokens_total") == 256


async def test_a_closed_session_is_torn_down_once(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    metrics = Metrics()
    session = Session(engines, SessionSettings.from_config(engines.cfg), metrics=metrics, clock=clock_of(engines))
    async with session:
        pass
    await session.aclose()
    assert engines.asr.closed == 1 and active_sessions(metrics) == 0
    never_opened = Session(engines, SessionSettings.from_config(engines.cfg), metrics=metrics)
    await never_opened.aclose()
    assert engines.asr.closed == 2 and active_sessions(metrics) == 0, "its stream is closed, the gauge untouched"


# ------------------------------------------------------- issue 8: client-side turns
async def test_audio_sent_during_a_commits_transcription_starts_the_next_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The reset after a committed turn's final wiped audio appended meanwhile."""
    engines = make_engines(tokenizer)
    async with call(engines, turn_detection=False, create_response=False) as c:
        await c.speak(500)
        first = c.session.commit_input()
        await c.speak(300)  # sent while the first turn is being transcribed (30 ms)
        await c.wait_for(ev.TranscriptFinal)
        second = c.session.commit_input()
        await until(c.clock, lambda: len(c.of(ev.TranscriptFinal)) == 2)
        assert [f.item_id for f in c.of(ev.TranscriptFinal)] == [first, second]
        assert engines.asr.final_audio_s == [0.5, 0.3], "each turn decodes exactly its own audio"
        assert engines.asr.closed == 2, "each committed turn's stream is closed once decoded"


# ------------------------------------------------------- issue 8: barge-in and queue
async def reply_queued_unread(engines: Engines, seconds: float) -> tuple[Session, Clock]:
    clock = clock_of(engines)
    session = Session(engines, SessionSettings.from_config(engines.cfg), clock=clock)
    await session.__aenter__()
    for level, ms in ((0.1, 600), (0.0, 600)):
        for _ in range(ms // 20):
            session.push_audio(np.full(FRAME, level, dtype=np.float32), RATE)
            await elapse(clock, 0.02)
    await elapse(clock, seconds)  # the reply plays, nobody reads: its audio queues up
    return session, clock


def drain(session: Session) -> list[object]:
    out = []
    while not session.outbox.empty():
        out.append(session.outbox.get_nowait())
    return out


@pytest.mark.parametrize("how", ["barge_in", "cancel"])
async def test_an_interrupted_reply_drops_its_queued_audio(tokenizer, how: str) -> None:  # type: ignore[no-untyped-def]
    """Barge-in cleared the playout but not the outgoing queue: up to out_queue_frames
    of reply audio were still sent before the barge-in event."""
    engines = make_engines(tokenizer, word_delay=0.01)
    session, clock = await reply_queued_unread(engines, 0.6)
    try:
        resp = session.speaker.live
        assert resp is not None and resp.playout.taken >= 25 * FRAME, "reply audio is waiting to be sent"
        rid = resp.id
        if how == "barge_in":
            for _ in range(12):  # 240 ms of speech over the reply
                session.push_audio(np.full(FRAME, 0.1, dtype=np.float32), RATE)
            session.listener.asr.hear("Hold on")  # type: ignore[attr-defined]  # words: a barge-in
            for _ in range(5):  # the partial reaches the call
                await asyncio.sleep(0)
        else:
            assert session.cancel_response()
        after = drain(session)
        kinds = [type(e).__name__ for e in after]
        assert not any(isinstance(e, ev.ResponseAudio) and e.response_id == rid for e in after), kinds
        control = ["SpeechStarted", "SpeechStopped", "TranscriptFinal", "ResponseStarted", "ResponseAudioStarted"]
        assert [k for k in kinds if k in control[1:]] == control[1:], "control events stay, in order"
        done = next(e for e in after if isinstance(e, ev.ResponseDone))
        assert done.status == ("interrupted" if how == "barge_in" else "cancelled")
        assert done.played_ms == 0 and done.text == "", "nothing was sent, so nothing was heard"
        if how == "barge_in":
            assert kinds.index("BargeIn") == kinds.index("ResponseDone") - 1
        await elapse(clock, 0.3)
        assert not any(isinstance(e, ev.ResponseAudio) for e in drain(session)), "playout stopped"
    finally:
        await session.aclose()


# ------------------------------------------------------------ issue 8: summaries
def long_exchange(session: Session, start: int, turns: int) -> None:
    for i in range(start, start + turns):
        session.add_text("user", f"Question number {i} about the weather in some faraway town?")
        session.add_text("assistant", f"Answer number {i}: it will be sunny and warm there.")


async def test_summaries_run_one_at_a_time_and_fold_every_dropped_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Two summaries ran at once, both from the old summary: the later one lost the
    turns of the other."""
    engines = make_engines(tokenizer, clock=REAL_CLOCK)
    engines.llm.summary_delay = 0.3
    with_session_cfg(engines, history_tokens=220)
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        long_exchange(c.session, 0, 6)  # a trim: the first summary starts
        await until(c.clock, lambda: engines.llm.summarising >= 1)
        long_exchange(c.session, 6, 6)  # more trims while it runs
        await until(c.clock, lambda: len(engines.llm.summary_prompts) >= 2 and not engines.llm.summarising)
        await asyncio.sleep(0.4)  # a summary beside another (there should be none) would have started by now
        assert engines.llm.most_summarising == 1, "one summary at a time"
        # Two for the trims (at a budget this small a compaction may follow the second).
        bg = c.session.core.background
        await until(c.clock, lambda: bg.summary is None and bg.compaction is None and bg.prefill is None)
        assert c.session.conversation.summary == f"Summary {len(engines.llm.summary_prompts)}."
        first, second = engines.llm.summary_prompts[:2]
        assert "(earlier: Summary 1.)" in second, "the second summary folds in the first"
        kept = {m.content for m in c.session.conversation.messages}
        for i in range(12):
            q = f"Question number {i} about"
            assert any(q in p for p in engines.llm.summary_prompts) or any(q in k for k in kept), f"turn {i} lost"
        assert not c.of(ev.ErrorEvent)


async def test_a_failed_summary_is_logged_not_sent_to_the_caller(tokenizer, caplog) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, clock=REAL_CLOCK)
    engines.llm.summary_fail = True
    with_session_cfg(engines, history_tokens=220)
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        long_exchange(c.session, 0, 6)
        await until(c.clock, lambda: engines.llm.summary_prompts and not engines.llm.summarising)
        await asyncio.sleep(0.05)
        assert not c.of(ev.ErrorEvent), "background work is invisible to the caller"
        assert "summary of 6 dropped messages failed" in caplog.text
        assert c.session.conversation.summary is None
        engines.llm.summary_fail = False  # the next trim is summarised again
        long_exchange(c.session, 6, 6)
        await until(c.clock, lambda: c.session.conversation.summary is not None)


async def test_closing_cancels_a_running_summary(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, clock=REAL_CLOCK)
    engines.llm.summary_delay = 30.0
    with_session_cfg(engines, history_tokens=220)
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        long_exchange(c.session, 0, 6)
        await until(c.clock, lambda: engines.llm.summarising == 1)
    assert engines.llm.summaries_cancelled == 1 and engines.llm.summarising == 0


# ------------------------------------------------------------ issue 8: big input
async def test_a_large_push_is_processed_in_slices_between_loop_turns(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """One 1 MiB message (32 s) was resampled and VAD-ed in one go: the loop (every
    session's pacer) stalled for all of it."""
    engines = make_engines(tokenizer)
    turns = 0  # loop turns seen by a task that yields at every turn
    per_turn: dict[int, int] = {}

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    async with call(engines) as c:
        tick = asyncio.create_task(ticker())
        vad = engines.vad
        vad.windows.clear()
        vad.on_process = lambda n: per_turn.__setitem__(turns, per_turn.get(turns, 0) + n)
        speech = np.concatenate([np.full(RATE * 2, 0.1), np.zeros(RATE * 30)]).astype(np.float32)
        pcm = (speech * 32767).astype("<i2").tobytes()
        assert len(pcm) <= 1 << 20  # 32 s: one message of the default 1 MiB limit
        c.session.push_audio(pcm, RATE)
        await until(c.clock, lambda: sum(vad.windows) >= 1000, timeout=10)
        tick.cancel()
        assert max(per_turn.values()) <= 4, "at most ~100 ms of audio between two loop turns"
        assert sum(vad.windows) == 1000
        await c.wait_for(ev.ResponseAudioStarted)  # the end of the turn is told with its reply
        assert [type(e) for e in c.events if isinstance(e, ev.SpeechStarted | ev.SpeechStopped)] == [
            ev.SpeechStarted,
            ev.SpeechStopped,
        ], "processed in order, as one 2 s utterance"


async def test_a_commit_after_a_large_push_takes_all_of_it_and_nothing_after(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    async with call(engines, turn_detection=False, create_response=False) as c:
        c.session.push_audio(np.full(RATE * 2, 0.1, dtype=np.float32), RATE)
        c.session.commit_input()
        c.session.push_audio(np.full(RATE * 3 // 10, 0.1, dtype=np.float32), RATE)
        await c.wait_for(ev.TranscriptFinal)
        c.session.commit_input()
        await until(c.clock, lambda: len(c.of(ev.TranscriptFinal)) == 2)
        assert engines.asr.final_audio_s == [2.0, 0.3]


async def test_input_beyond_the_backlog_bound_is_refused_and_the_call_goes_on(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    with_session_cfg(engines, max_input_backlog_s=10.0)
    async with call(engines) as c:
        c.session.push_audio(np.zeros(RATE * 8, dtype=np.float32), RATE)
        with pytest.raises(BadAudio) as info:
            c.session.push_audio(np.zeros(RATE * 4, dtype=np.float32), RATE)
        assert info.value.code == "input_backlog_full"
        await c.pause(0.1)
        await c.speak(600)
        await c.silence(700)
        assert (await c.wait_for(ev.ResponseDone)).status == "completed"


async def test_text_input_is_bounded(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    with_session_cfg(engines, max_text_chars=100)
    async with call(engines, turn_detection=False) as c:
        with pytest.raises(BadMessage) as info:
            c.session.add_text("user", "x" * 101)
        assert info.value.code == "text_too_long"
        assert not c.session.conversation.messages
        c.session.add_text("user", "x" * 100)
        assert len(c.session.conversation.messages) == 1


# ------------------------------------------------ issue 8: nothing outlives a session
@pytest.mark.parametrize("phase", ["listening", "speculating", "speaking", "committing"])
async def test_every_task_ends_with_the_session_in_each_phase(tokenizer, phase: str) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.05)
    engines.tts.delay = 0.2  # a clause is being synthesised when the call ends
    before = asyncio.all_tasks()
    async with call(engines, turn_detection=phase != "committing") as c:
        if phase == "listening":
            await c.speak(300)
        elif phase == "speculating":
            await c.speak(600)
            await c.silence(300)  # past the pause, short of the end of turn
            assert engines.llm.started and not c.of(ev.SpeechStopped)
        elif phase == "speaking":
            await c.speak(600)
            await c.silence(500)
            await c.wait_for(ev.ResponseAudioStarted)
        else:
            await c.speak(300)
            c.session.commit_input()  # hung up while the turn is transcribed
            c.session.push_audio(np.zeros(RATE * 5, dtype=np.float32), RATE)  # and a backlog
        assert len(asyncio.all_tasks() - before) > 2
    await clock_of(engines).settle()  # type: ignore[attr-defined]
    assert asyncio.all_tasks() - before == set(), [t.get_name() for t in asyncio.all_tasks() - before]
    llm, tts = engines.llm, engines.tts
    assert len(llm.completed) + len(llm.aborted) == len(llm.started), "every LLM request ended"
    if phase in ("speculating", "speaking"):
        assert llm.aborted, "the unfinished request was aborted"
    assert tts.started == tts.finished + tts.aborted, "no synthesis left running"
    assert all(s.closed for s in engines.asr.streams), "every ASR stream closed"


async def test_cancelling_a_reply_aborts_its_llm_request_and_pending_tts(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.05)
    engines.tts.delay = 0.3
    with_session_cfg(engines, first_clause_words=2, max_clause_words=3)  # TTS stays busy
    async with call(engines, turn_detection=False) as c:
        c.session.add_text("user", "Tell me about the weather.")
        c.session.create_response()
        await c.wait_for(ev.ResponseAudioStarted)
        await c.pause(0.1)
        assert engines.tts.started > engines.tts.finished, "a clause is being synthesised"
        assert c.session.cancel_response()
        await c.pause(0.05)
        assert engines.llm.aborted == engines.llm.started == ["r0"]
        assert engines.tts.aborted >= 1 and engines.tts.started == engines.tts.finished + engines.tts.aborted
        assert (await c.wait_for(ev.ResponseDone)).status == "cancelled"
        await c.pause(1.0)
        assert engines.tts.started == engines.tts.finished + engines.tts.aborted, "nothing new synthesised"


# ------------------------------------------------------ issue 12: Smart Turn verdicts
async def test_a_finished_verdict_after_the_last_audio_still_ends_the_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The end-of-turn model's answer was read only when the next audio window came: a
    client that streamed its question faster than real time (the Agents SDK test, a WAV
    at ~10x) or stops sending at a pause was never answered with Smart Turn on."""
    from concurrent.futures import Future

    class HeldModel:
        def __init__(self) -> None:
            self.futures: list[Future[float]] = []

        def submit(self, audio16k: np.ndarray) -> Future[float]:
            self.futures.append(Future())
            return self.futures[-1]

    engines = make_engines(tokenizer)
    model = HeldModel()
    engines.turn_model = model  # type: ignore[assignment]
    vad = engines.cfg.vad.model_copy(update={"turn_detector": "smart_turn", "smart_turn_check_ms": 192})
    async with call(engines, vad=vad) as c:
        await c.speak(600)
        await c.silence(300)  # past the check: the model is asked; then the client sends nothing
        await until(c.clock, lambda: bool(model.futures))
        await elapse(c.clock, 0.5)
        assert not c.of(ev.TranscriptFinal)
        model.futures[0].set_result(0.9)  # finished
        await until(c.clock, lambda: bool(c.of(ev.ResponseDone)))
        assert c.of(ev.TranscriptFinal)


async def test_a_reply_written_slower_than_it_is_read_for_the_first_clause_leaves_no_long_silence(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The model writes a word in 60 ms and the voice says it in 100 ms (FakeTts): faster
    # than real time, as the CPU default's ~6 tokens/s against ~3 spoken words/s. But a
    # short first clause ("Sure,") was followed by the rest of the sentence cut only at
    # its full stop: 2 s of writing while 0.1 s of audio played. Seen in the voice loop
    # on the CPU default: 1-3 s of silence mid-reply in 10 of 12 replies.
    reply = ("Sure, the sun will shine all day long over the hills and over the sea and over the old town "
             "and over the river and the park until late tonight when it gets cold again.")
    engines = make_engines(tokenizer, reply=reply, word_delay=0.06)
    sent: list[float] = []
    async with call(engines, turn_detection=False) as c:
        put = c.session.outbox.put_nowait

        def timed(e: object) -> None:  # when the pacer sends each 20 ms frame
            if isinstance(e, ev.ResponseAudio):
                sent.append(c.clock.monotonic())
            put(e)  # type: ignore[arg-type]

        c.session.outbox.put_nowait = timed  # type: ignore[method-assign]
        c.session.add_text("user", "How will the weather be?")
        c.session.create_response()
        done = await c.wait_for(ev.ResponseDone, timeout=30)
    assert done.status == "completed" and len(sent) > 100
    longest = max(b - a for a, b in zip(sent, sent[1:], strict=False))
    assert longest < 0.35, f"{longest:.2f} s of silence in the reply"


async def test_a_model_that_writes_fast_keeps_its_sentences_whole_after_a_short_first_clause(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # "Sure!" is 0.1 s of audio (FakeTts): less than the low water. A model that writes a
    # word a millisecond (a GPU's ~100 tokens/s against a voice's 3 words/s is the same
    # ratio) finishes the next sentence long before that runs out, so the sentence is
    # not cut into pieces, each spoken as a sentence of its own.
    reply = "Sure! The sun will shine all day long over the hills and the sea until late tonight."
    engines = make_engines(tokenizer, reply=reply, word_delay=0.001)
    async with call(engines, turn_detection=False) as c:
        c.session.add_text("user", "How will the weather be?")
        c.session.create_response()
        done = await c.wait_for(ev.ResponseDone, timeout=30)
    assert done.status == "completed"
    assert engines.tts.started == 2, f"{engines.tts.started} clauses for 2 sentences"  # type: ignore[attr-defined]
