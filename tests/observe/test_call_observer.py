"""A whole call with fakes of the engines (virtual clock), watched through the session's
observer seam: its record and its trace say what happened, and a failing observer
never reaches the call."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fakes import Caller, clock_of, make_engines, until
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from voicebot.config import TelemetryConfig
from voicebot.metrics import Metrics
from voicebot.observe.records import CallRecorder
from voicebot.observe.telemetry import CallTelemetry, Telemetry
from voicebot.observe.tracing import CallTracer
from voicebot.session import events as ev
from voicebot.session.observer import CallObserver
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings

STAGES = {"endpointing", "asr", "llm", "first_clause", "tts", "playout"}


async def _barge_in_then_a_full_reply(tokenizer, observer: CallObserver) -> tuple[Session, Caller]:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, word_delay=0.01)
    clock = clock_of(engines)
    session = Session(engines, SessionSettings.from_config(engines.cfg), clock=clock, observer=observer)
    async with session:
        c = Caller(session, clock)
        await c.speak(600)
        await c.silence(500)
        await c.wait_for(ev.ResponseAudioStarted)
        await c.pause(0.6)
        await c.speak(400)  # the caller talks over the reply
        session.listener.asr.hear("Hold on")  # type: ignore[attr-defined]  # words: a barge-in
        await c.wait_for(ev.BargeIn)
        await c.silence(600)
        await until(clock, lambda: len(c.of(ev.ResponseDone)) == 2, timeout=20)
        await c.close()
    return session, c


async def test_the_record_and_the_trace_of_a_call_with_a_barge_in(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    metrics = Metrics()
    telemetry = Telemetry(TelemetryConfig(record_dir=str(tmp_path)), metrics, environ={})
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    recorder = CallRecorder(max_turns=50, max_text_chars=1000)
    observer = CallTelemetry(telemetry, recorder, CallTracer(provider.get_tracer("t"), include_text=False))

    session, c = await _barge_in_then_a_full_reply(tokenizer, observer)
    await telemetry.aclose()  # the writer thread wrote what was queued

    files = os.listdir(tmp_path)
    assert len(files) == 1 and session.id in files[0] and files[0].endswith(".json")
    with open(tmp_path / files[0], encoding="utf-8") as f:  # noqa: ASYNC230 (a test's small file)
        record = json.load(f)
    assert record == recorder.document()
    assert record["call_id"] == session.id and record["protocol"] == "native"
    assert record["end_reason"] == "closed" and record["hung_up_by"] == "caller"
    barge = c.of(ev.BargeIn)[0]
    done = c.of(ev.ResponseDone)
    replies = [r for t in record["turns"] for r in t["replies"]]
    assert [r["response_id"] for r in replies] == [d.response_id for d in done]
    first, second = replies
    assert first["status"] == "interrupted" and second["status"] == "completed"
    assert first["barge_in"]["heard"] == barge.heard_text == first["heard"]
    assert first["text"] == done[0].full_text and first["heard"] != first["text"]
    assert second["heard"] == second["text"] == done[1].full_text
    timings = {t.response_id: t for t in c.of(ev.TurnTimings)}
    assert first["timings"]["voice_to_voice_ms"] == timings[first["response_id"]].voice_to_voice_ms
    transcripts = [e.text for e in c.of(ev.TranscriptFinal) if e.text.strip()]
    assert [t["transcript"] for t in record["turns"]] == transcripts
    summary = record["summary"]
    assert summary["barge_ins"] == 1 and summary["replies"] == 2 and summary["turns"] == len(transcripts)
    assert summary["voice_to_voice_ms"]["max"] >= summary["voice_to_voice_ms"]["p50"] > 0
    assert metrics.records.labels("written")._value.get() == 1

    spans = exporter.get_finished_spans()
    (call,) = [s for s in spans if s.name == "call"]
    assert call.parent is None
    assert call.attributes["voicebot.call_id"] == session.id and call.attributes["voicebot.protocol"] == "native"
    assert call.attributes["voicebot.hung_up_by"] == "caller"
    turns = [s for s in spans if s.name == "turn"]
    assert [t.attributes["voicebot.response_id"] for t in turns] == [d.response_id for d in done]
    for turn in turns:
        assert turn.parent.span_id == call.context.span_id and turn.context.trace_id == call.context.trace_id
        children = [s for s in spans if s.parent is not None and s.parent.span_id == turn.context.span_id]
        assert {s.name for s in children} == STAGES
        for child in children:
            assert turn.start_time <= child.start_time <= child.end_time <= turn.end_time, child.name
        assert call.start_time <= turn.start_time <= turn.end_time <= call.end_time
    llm = next(s for s in spans if s.name == "llm" and s.parent.span_id == turns[1].context.span_id)
    assert llm.attributes["gen_ai.usage.output_tokens"] == done[1].output_tokens  # the fake counts none
    assert llm.attributes["gen_ai.usage.input_tokens"] == done[1].input_tokens
    (barge_event,) = [e for t in turns for e in t.events if e.name == "barge_in"]
    assert barge_event.attributes["voicebot.played_ms"] == barge.played_ms
    # No caller or reply text in spans unless telemetry.include_text.
    assert not any("heard" in k or "transcript" in k for s in spans for k in s.attributes)
    assert not any("heard" in k for t in turns for e in t.events for k in e.attributes)


async def test_include_text_puts_the_words_in_the_spans(tokenizer) -> None:  # type: ignore[no-untyped-def]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = CallTracer(provider.get_tracer("t"), include_text=True)
    _, c = await _barge_in_then_a_full_reply(tokenizer, tracer)
    turns = [s for s in exporter.get_finished_spans() if s.name == "turn"]
    transcripts = [e.text for e in c.of(ev.TranscriptFinal) if e.text.strip()]
    assert [t.attributes["voicebot.transcript"] for t in turns] == transcripts
    (barge_event,) = [e for t in turns for e in t.events if e.name == "barge_in"]
    assert barge_event.attributes["voicebot.heard"] == c.of(ev.BargeIn)[0].heard_text


class Broken:
    """An observer that fails at everything."""

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        def fail(*_: object) -> None:
            raise RuntimeError(f"{name} broke")
        return fail


async def test_a_failing_observer_never_reaches_the_call(tokenizer, caplog) -> None:  # type: ignore[no-untyped-def]
    telemetry = Telemetry(TelemetryConfig(), Metrics(), environ={})
    observer = CallTelemetry(telemetry, None, None)
    observer._observers = [Broken()]  # type: ignore[list-item]
    session, c = await _barge_in_then_a_full_reply(tokenizer, observer)
    assert [d.status for d in c.of(ev.ResponseDone)] == ["interrupted", "completed"]
    assert session.closed_reason == "closed"
    failures = [r for r in caplog.records if "call telemetry failed" in r.getMessage()]
    assert len(failures) == 1, "logged once per call"


def in_memory_tracer(include_text: bool) -> tuple[CallTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return CallTracer(provider.get_tracer("t"), include_text=include_text), exporter


def test_a_calls_details_are_on_its_span_and_numbers_only_with_include_text() -> None:
    for include_text in (False, True):
        tracer, exporter = in_memory_tracer(include_text)
        tracer.started("sess_1", "twilio", 10.0)
        tracer.details({"carrier": "twilio", "carrier_call_id": "CA1", "from": "+15550100001", "to": "+15550100002"})
        tracer.ended("call ended", 12.0)
        (call,) = exporter.get_finished_spans()
        assert call.attributes["voicebot.carrier_call_id"] == "CA1" and call.attributes["voicebot.carrier"] == "twilio"
        assert ("voicebot.from" in call.attributes) is include_text and ("voicebot.to" in call.attributes) is include_text


def test_a_client_truncate_is_an_event_of_the_call_span_with_the_words_only_with_include_text() -> None:
    # The reply's turn span ended with the reply; the truncate comes later, from the client.
    for include_text in (False, True):
        tracer, exporter = in_memory_tracer(include_text)
        tracer.started("sess_1", "openai-realtime", 10.0)
        tracer.event(ev.ReplyTruncated("resp_1", "item_1", 700, "It is"), 11.5)
        tracer.ended("client closed", 12.0)
        (call,) = exporter.get_finished_spans()
        (event,) = call.events
        assert event.name == "truncated" and event.timestamp == call.start_time + 1_500_000_000
        assert event.attributes["voicebot.response_id"] == "resp_1" and event.attributes["voicebot.played_ms"] == 700
        assert (event.attributes.get("voicebot.heard") == "It is") is include_text
