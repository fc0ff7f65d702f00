"""OpenAI Realtime compatibility at /v1/realtime.

The translator and G.711 are tested directly (synchronous, with a recording stand-in
for the Session); the rest runs the real app (real ASR, LLM, TTS) on a real socket and
talks to it with the official ``openai`` SDK, or raw websockets where a test must send
what the SDK would refuse to.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import jiwer
import numpy as np
import pytest
import websockets
from fakes import StepClock
from openai import AsyncOpenAI
from servers import FAST_SPEECH, EnginePool, running_server, server_errors
from speech import Clip

from voicebot.audio import dbfs, float_to_pcm16, pcm16_to_float, resample
from voicebot.config import ModelsConfig, load_config
from voicebot.probe.client import ProbeConfig, run_level
from voicebot.probe.clips import load_clip
from voicebot.server import edge
from voicebot.server.state import ServerState
from voicebot.session import events as se
from voicebot.session.settings import SessionSettings
from voicebot.transports.realtime_session import RealtimeTranslator
from voicebot.wire import g711

KEY = "sk-test-realtime"
TIMEOUT = 60.0  # per exchange; the CPU is shared with other test runs


def norm(text: str) -> str:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).strip()


def wer(ref: str, hyp: str) -> float:
    return float(jiwer.wer(norm(ref), norm(hyp) or "<empty>"))


# ---------------------------------------------------------------------- G.711
@pytest.mark.parametrize("fmt", ["audio/pcmu", "audio/pcma"])
def test_g711_round_trip_keeps_the_signal(fmt: str) -> None:
    t = np.arange(8000) / 8000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    coded = g711.encode(fmt, float_to_pcm16(tone))  # type: ignore[arg-type]
    assert len(coded) == tone.size  # one byte a sample
    back = pcm16_to_float(g711.decode(fmt, coded))  # type: ignore[arg-type]
    snr = 10 * np.log10(np.sum(tone**2) / np.sum((tone - back) ** 2))
    assert snr > 30, snr  # G.711 gives ~38 dB on a loud tone


def test_g711_silence_codes() -> None:
    silence = bytes(4)
    assert g711.encode("audio/pcmu", silence) == b"\xff\xff"
    assert g711.encode("audio/pcma", silence) == b"\xd5\xd5"


# ----------------------------------------------------------------- translator
class FakeSession:
    """Records what the translator asks of the session (the Session interface only)."""

    def __init__(self) -> None:
        self.settings = SessionSettings(system_prompt="Be brief.")
        self.conversation = self
        self.calls: list[tuple[Any, ...]] = []
        self.response_running = False
        self.input_ms = 0.0
        self.budget_tokens = 1024

    token_count = 100

    def push_audio(self, audio: bytes, sample_rate: int) -> None:
        self.calls.append(("push", len(audio), sample_rate))

    def commit_input(self) -> str:
        return "item_u1"

    def clear_input(self) -> None:
        self.calls.append(("clear",))

    def add_text(self, role: str, text: str, item_id: str | None = None) -> str:
        self.calls.append(("add", role, text))
        return item_id or "item_t1"

    def create_response(self, options: Any = None) -> str:
        self.calls.append(("respond",))
        return "resp_1"

    def set_tools(self, tools: Any = None, choice: Any = None) -> None:
        self.calls.append(("tools", tools, choice))

    def add_tool_result(self, call_id: str, output: str, item_id: str | None = None) -> str:
        return item_id or "item_fo1"

    def add_tool_call(self, call_id: str, name: str, arguments: str, item_id: str | None = None) -> str:
        return item_id or "item_fc1"

    def cancel_response(self) -> bool:
        self.calls.append(("cancel",))
        return self.response_running

    def truncate(self, item_id: str, audio_end_ms: int) -> str | None:
        self.calls.append(("truncate", item_id, audio_end_ms))
        return "heard" if item_id == "item_a1" else None

    def set_played(self, ms: int) -> None:
        self.calls.append(("played", ms))

    def update_settings(self, **changes: object) -> None:
        self.settings = SessionSettings.model_validate({**self.settings.model_dump(), **{
            k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in changes.items()}})

    def delete(self, item_id: str) -> bool:
        return item_id == "item_t1"


def make(beta: bool = False, **kw: Any) -> tuple[RealtimeTranslator, FakeSession]:
    fake = FakeSession()
    return RealtimeTranslator(fake, session_id="sess_x", model="m", beta=beta, **kw), fake


def send(tr: RealtimeTranslator, **event: Any) -> list[dict[str, Any]]:
    return tr.client_message(json.dumps(event))


def test_session_update_maps_ga_fields_onto_settings() -> None:
    tr, fake = make()
    assert tr.opening()[0]["type"] == "session.created"
    out = send(tr, type="session.update", session={
        "type": "realtime", "instructions": "Talk like a pirate.",
        "audio": {"input": {"format": {"type": "audio/pcmu"},
                            "turn_detection": {"type": "server_vad", "threshold": 0.7, "prefix_padding_ms": 200,
                                               "silence_duration_ms": 600, "create_response": False,
                                               "interrupt_response": False}},
                  "output": {"format": {"type": "audio/pcma"}, "voice": "marin", "speed": 1.2}},
        "max_output_tokens": 40})
    assert [e["type"] for e in out] == ["session.updated"]
    s = fake.settings
    assert (s.system_prompt, s.vad.threshold, s.vad.prefix_padding_ms, s.vad.min_silence_ms) == (
        "Talk like a pirate.", 0.7, 200, 600)
    assert (s.create_response, s.interrupt_response, s.turn_detection, s.max_tokens, s.speed, s.voice) == (
        False, False, True, 40, 1.2, None)
    audio = out[0]["session"]["audio"]
    assert audio["input"]["format"] == {"type": "audio/pcmu"}
    assert audio["output"] == {"format": {"type": "audio/pcma"}, "voice": "marin", "speed": 1.2}
    out = send(tr, type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    assert fake.settings.turn_detection is False and out[0]["session"]["audio"]["input"]["turn_detection"] is None
    assert fake.settings.create_response is False  # as OpenAI: no VAD, no automatic reply


def test_a_session_update_naming_unknown_fields_is_refused_whole_and_names_them() -> None:
    # Unknown names were dropped silently (the models ignore extras): a typo
    # ("instructionz", "silence_ms") was answered session.updated and changed nothing the
    # client meant. OpenAI refuses the whole update with unknown_parameter.
    tr, fake = make()
    out = send(tr, type="session.update", event_id="ev_1", session={
        "type": "realtime", "instructions": "Talk like a pirate.", "instructionz": "Talk like a pirate.",
        "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_ms": 300}}}})
    assert [e["type"] for e in out] == ["error"], out
    error = out[0]["error"]
    assert (error["type"], error["code"], error["param"], error["event_id"]) == (
        "invalid_request_error", "unknown_parameter", "session.instructionz", "ev_1")
    assert "'session.instructionz'" in error["message"], error
    assert "'session.audio.input.turn_detection.silence_ms'" in error["message"], error
    assert fake.settings.system_prompt == "Be brief.", "a refused update changed the session"
    out = send(tr, type="session.update", session={"input_audio_format": "pcm16", "turn_detection": {"silence": 1}})
    assert out[0]["error"]["param"] == "session.turn_detection.silence", out  # beta names too


def _typed_dict_fields(hint: Any, seen: frozenset[type] = frozenset()) -> dict[str, Any]:
    """A TypedDict's fields as nested dicts ({} where the field is not an object), the
    members of a union of TypedDicts merged."""
    import typing

    import typing_extensions  # the SDK's TypedDicts are typing_extensions'

    fields: dict[str, Any] = {}
    for arg in typing.get_args(hint) or (hint,):
        if typing.get_origin(arg) in (typing_extensions.Required, typing_extensions.NotRequired) or typing.get_args(arg):
            fields.update(_typed_dict_fields(arg, seen))
        elif typing_extensions.is_typeddict(arg) and arg not in seen:
            for name, inner in typing.get_type_hints(arg).items():
                fields[name] = _typed_dict_fields(inner, seen | {arg}) or None
    return fields


@pytest.mark.parametrize("schema", [
    "openai.types.realtime.realtime_session_create_request_param:RealtimeSessionCreateRequestParam",
    "openai.types.realtime.realtime_transcription_session_create_request_param:"
    "RealtimeTranscriptionSessionCreateRequestParam",
    "openai.types.beta.realtime.session_update_event_param:Session",
])
def test_every_session_field_the_openai_sdk_can_send_is_known(schema: str) -> None:
    # What a client may send is OpenAI's schema (the SDK's types): none of it may be
    # refused as unknown, whether we implement it or accept it as a no-op.
    import importlib

    module, name = schema.split(":")
    session = _typed_dict_fields(getattr(importlib.import_module(module), name))
    assert "instructions" in session or "audio" in session, session
    from voicebot.transports import realtime_events as rt

    assert rt.unknown_session_fields(session) == []


def test_flat_beta_fields_switch_to_beta_names() -> None:
    tr, fake = make()
    out = send(tr, type="session.update", session={"input_audio_format": "g711_ulaw", "turn_detection": None})
    assert out[0]["session"]["input_audio_format"] == "g711_ulaw" and tr.fam.beta
    assert fake.settings.turn_detection is False
    send(tr, type="input_audio_buffer.append", audio=base64.b64encode(bytes(800)).decode())
    assert fake.calls[-1] == ("push", 1600, 8000)  # μ-law decoded to PCM16 at 8 kHz
    out = tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    assert [e["type"] for e in out] == ["response.created", "rate_limits.updated", "response.output_item.added",
                                        "conversation.item.created", "response.content_part.added"]
    assert out[1]["rate_limits"] == [{"name": "tokens", "limit": 1024, "remaining": 924, "reset_seconds": 0.0}]
    out = tr.session_event(se.ResponseTextDelta("resp_1", "item_a1", "Hi"))
    assert out[0]["type"] == "response.audio_transcript.delta"


def test_reply_sequence_and_barge_in_order() -> None:
    tr, _ = make()
    seen = [e["type"] for e in tr.session_event(se.SpeechStarted(900, "item_u1"))]
    seen += [e["type"] for e in tr.session_event(se.TranscriptPartial("item_u1", "hello", "there"))]
    seen += [e["type"] for e in tr.session_event(se.SpeechStopped(2500, "item_u1"))]
    final = tr.session_event(se.TranscriptFinal("item_u1", "hello there"))
    assert [e["type"] for e in final] == ["conversation.item.input_audio_transcription.delta",
                                          "conversation.item.input_audio_transcription.completed",
                                          "conversation.item.done"]
    assert final[0]["delta"] == " there" and final[1]["transcript"] == "hello there"
    assert seen == ["input_audio_buffer.speech_started", "conversation.item.input_audio_transcription.delta",
                    "input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "conversation.item.added"]
    tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    tr.session_event(se.ResponseTextDelta("resp_1", "item_a1", "Ahoy"))
    audio = [e for _ in range(10) for e in tr.session_event(
        se.ResponseAudio("resp_1", "item_a1", np.full(320, 0.1, np.float32), 16000))]
    pcm = b"".join(base64.b64decode(e["delta"]) for e in audio)
    assert {e["type"] for e in audio} == {"response.output_audio.delta"}
    assert 4000 <= len(pcm) // 2 <= 4800  # 200 ms at 24 kHz, less the resampler's delay
    # The session reports a barge-in as BargeIn, ResponseDone, then SpeechStarted; the
    # client must see the speech first, then the cancelled reply.
    assert tr.session_event(se.BargeIn("resp_1", 20, "Ahoy")) == []
    assert tr.session_event(se.ResponseDone("resp_1", "item_a1", "interrupted", "Ahoy", "Ahoy ho", 20)) == []
    out = tr.session_event(se.SpeechStarted(4000, "item_u2"))
    types = [e["type"] for e in out]
    assert types == ["input_audio_buffer.speech_started", "response.output_audio.done",
                     "response.output_audio_transcript.done", "response.content_part.done",
                     "response.output_item.done", "conversation.item.done", "response.done"]
    done = out[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    assert done["output"][0]["content"][0] == {"type": "output_audio", "transcript": "Ahoy"}
    assert len({e["event_id"] for e in out}) == len(out)
    # Late audio of the finished reply is dropped.
    assert tr.session_event(se.ResponseAudio("resp_1", "item_a1", np.zeros(320, np.float32), 16000)) == []


def test_max_tokens_reply_is_incomplete_and_client_events_answer() -> None:
    tr, fake = make()
    tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    out = tr.session_event(se.ResponseDone("resp_1", "item_a1", "completed", "x", "x", 10, "length", 30, 12))
    resp = out[-1]["response"]
    assert (resp["status"], resp["status_details"]["reason"]) == ("incomplete", "max_output_tokens")
    assert {k: resp["usage"][k] for k in ("total_tokens", "input_tokens", "output_tokens")} == {
        "total_tokens": 42, "input_tokens": 30, "output_tokens": 12}
    out = send(tr, type="conversation.item.create", item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": "Hi"}]})
    assert [e["type"] for e in out] == ["conversation.item.added", "conversation.item.done"]
    assert fake.calls[-1] == ("add", "user", "Hi")
    out = send(tr, type="conversation.item.truncate", item_id="item_a1", content_index=0, audio_end_ms=5)
    assert out[0]["error"]["param"] == "audio_end_ms"  # no audio of it was sent
    out = send(tr, type="conversation.item.truncate", item_id="item_a1", content_index=0, audio_end_ms=0)
    assert out[0] == {"type": "conversation.item.truncated", "event_id": out[0]["event_id"],
                      "item_id": "item_a1", "content_index": 0, "audio_end_ms": 0}
    assert send(tr, type="conversation.item.delete", item_id="item_t1")[0]["type"] == "conversation.item.deleted"
    err = send(tr, type="response.cancel", event_id="c1")[0]
    assert err["error"]["code"] == "response_cancel_not_active" and err["error"]["event_id"] == "c1"


# ------------------------------------------------- what third-party clients rely on
def test_item_retrieve_answers_retrieved_and_a_missing_item_in_openais_shape() -> None:
    # The Agents SDK retrieves the current item after every transcription and truncation.
    tr, _ = make()
    tr.session_event(se.SpeechStarted(900, "item_u1"))
    tr.session_event(se.SpeechStopped(2500, "item_u1"))
    tr.session_event(se.TranscriptFinal("item_u1", "hello there"))
    tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    tr.session_event(se.ResponseTextDelta("resp_1", "item_a1", "Ahoy"))
    tr.session_event(se.ResponseDone("resp_1", "item_a1", "completed", "Ahoy", "Ahoy", 0))
    (got,) = send(tr, type="conversation.item.retrieve", item_id="item_u1", event_id="r1")
    assert got["type"] == "conversation.item.retrieved", got
    assert got["item"]["id"] == "item_u1" and got["item"]["role"] == "user"
    assert got["item"]["content"] == [{"type": "input_audio", "transcript": "hello there"}]
    (got,) = send(tr, type="conversation.item.retrieve", item_id="item_a1")
    assert got["item"]["content"] == [{"type": "output_audio", "transcript": "Ahoy"}], got
    (err,) = send(tr, type="conversation.item.retrieve", item_id="nope", event_id="r2")
    assert err["error"] == {"type": "invalid_request_error", "code": "item_retrieve_invalid_item_id",
                            "message": "Error retrieving item: the item with id 'nope' does not exist.",
                            "param": None, "event_id": "r2"}
    # A deleted item is gone for retrieve too.
    send(tr, type="conversation.item.create", item={"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": "Hi"}]})
    send(tr, type="conversation.item.delete", item_id="item_t1")
    (err,) = send(tr, type="conversation.item.retrieve", item_id="item_t1")
    assert err["error"]["code"] == "item_retrieve_invalid_item_id"


def test_response_metadata_is_echoed_in_created_and_done() -> None:
    # LiveKit's generate_reply waits for metadata.client_event_id in response.created.
    tr, _ = make()
    meta = {"client_event_id": "response_create_abc"}
    assert send(tr, type="response.create", event_id="response_create_abc", response={"metadata": meta}) == []
    out = tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    assert out[0]["type"] == "response.created" and out[0]["response"]["metadata"] == meta, out[0]
    out = tr.session_event(se.ResponseDone("resp_1", "item_a1", "completed", "x", "x", 0))
    assert out[-1]["type"] == "response.done" and out[-1]["response"]["metadata"] == meta
    # A reply the client did not ask for (server VAD) has none.
    out = tr.session_event(se.ResponseStarted("resp_2", "item_a2"))
    assert out[0]["response"]["metadata"] is None


def test_cancel_with_nothing_active_answers_openais_text() -> None:
    # LiveKit cancels on every speech_started and ignores errors starting "Cancellation failed".
    tr, _ = make()
    (err,) = send(tr, type="response.cancel", event_id="c1")
    assert err["error"] == {"type": "invalid_request_error", "code": "response_cancel_not_active",
                            "message": "Cancellation failed: no active response found",
                            "param": None, "event_id": "c1"}


def test_a_cancel_only_reaches_a_reply_the_client_knows_of() -> None:
    # LiveKit cancels on every speech_started, after the server already cancelled the
    # barged reply; by then the session may be preparing the new turn's reply: keep it.
    tr, fake = make()
    fake.response_running = True  # the session has a (speculative) reply of its own
    (err,) = send(tr, type="response.cancel")
    assert err["error"]["message"].startswith("Cancellation failed") and ("cancel",) not in fake.calls
    send(tr, type="response.create")  # asked for: cancellable before response.created is out
    assert send(tr, type="response.cancel") == [] and fake.calls[-1] == ("cancel",)
    tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    tr.session_event(se.ResponseDone("resp_1", "item_a1", "cancelled", "", "", 0))
    fake.calls.clear()
    (err,) = send(tr, type="response.cancel", response_id="resp_1")  # over already
    assert err["error"]["code"] == "response_cancel_not_active" and not fake.calls


# Valid GA client events as real clients send them (fields we do not implement included):
# none may get an error (Pipecat closes its session on any error event).
VALID_GA_EVENTS: list[dict[str, Any]] = [
    {"type": "session.update", "session": {  # the Agents SDK's defaults, then its tracing update
        "type": "realtime", "model": "gpt-realtime", "output_modalities": ["audio"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "transcription": {"model": "gpt-4o-mini-transcribe"},
                            "turn_detection": {"type": "semantic_vad", "interrupt_response": True}},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "ash"}},
        "tools": [], "instructions": "Be brief."}},
    {"type": "session.update", "session": {"type": "realtime", "model": "gpt-realtime", "tracing": "auto"}},
    {"type": "session.update", "session": {  # LiveKit's
        "type": "realtime", "model": "gpt-realtime", "output_modalities": ["audio"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "noise_reduction": {"type": "near_field"},
                            "transcription": {"model": "gpt-4o-mini-transcribe", "language": "en",
                                              "prompt": ""},
                            "turn_detection": {"type": "semantic_vad", "eagerness": "medium",
                                               "create_response": True, "interrupt_response": True}},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}, "speed": 1.0,
                             "voice": "marin"}},
        "max_output_tokens": "inf", "tool_choice": "auto", "tracing": None,
        "truncation": {"type": "retention_ratio", "retention_ratio": 0.8}, "prompt": None,
        "include": ["item.input_audio_transcription.logprobs"]}},
    {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
        "idle_timeout_ms": 6000, "create_response": True, "interrupt_response": True}}}}},
    {"type": "conversation.item.create", "previous_item_id": "root", "item": {
        "id": "item_lk_1", "type": "message", "role": "system", "status": "completed",
        "content": [{"type": "input_text", "text": "Speak English."}]}},
    {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}]}},
    {"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "Hello."}]}},
    {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}},  # LiveKit's video
    {"type": "conversation.item.retrieve", "item_id": "item_seed"},
    {"type": "output_audio_buffer.clear"},
    {"type": "input_audio_buffer.clear"},
    {"type": "response.create", "response": {
        "conversation": "auto", "output_modalities": ["audio"], "instructions": "Say hi.",
        "metadata": {"client_event_id": "e1"}, "max_output_tokens": "inf", "tool_choice": "auto",
        "audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin"}}}},
    {"type": "response.cancel"},
    {"type": "response.cancel", "response_id": "resp_1"},
]


@pytest.mark.parametrize("event", VALID_GA_EVENTS, ids=lambda e: str(e["type"]))
def test_valid_ga_events_never_get_an_error(event: dict[str, Any]) -> None:
    tr, fake = make()
    if event["type"] == "response.cancel":  # something to cancel
        fake.response_running = True
        tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    send(tr, type="conversation.item.create", item={"id": "item_seed", "type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": "Hi"}]})
    out = send(tr, **event)
    assert not [e for e in out if e["type"] == "error"], out


# ------------------------------------------------------------- the GA surface
def test_transcription_session_transcribes_and_never_replies() -> None:
    tr, fake = make(transcription_only=True)  # ?intent=transcription
    session = tr.opening()[0]["session"]
    assert (session["type"], session["object"]) == ("transcription", "realtime.transcription_session")
    assert "output_modalities" not in session and fake.settings.create_response is False
    out = send(tr, type="session.update", session={"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 24000}, "noise_reduction": {"type": "far_field"},
        "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
        "turn_detection": {"type": "server_vad", "silence_duration_ms": 500, "create_response": True}}},
        "include": ["item.input_audio_transcription.logprobs"]})
    assert out[0]["type"] == "session.updated" and out[0]["session"]["type"] == "transcription", out
    assert fake.settings.create_response is False and fake.settings.turn_detection is True
    tr.session_event(se.SpeechStarted(900, "item_u1"))
    tr.session_event(se.SpeechStopped(2500, "item_u1"))
    final = tr.session_event(se.TranscriptFinal("item_u1", "hello there"))
    assert "conversation.item.input_audio_transcription.completed" in [e["type"] for e in final]
    (err,) = send(tr, type="response.create")
    assert err["error"]["param"] == "type" and ("respond",) not in fake.calls
    # A realtime session may become a transcription one (and back).
    tr, fake = make()
    out = send(tr, type="session.update", session={"type": "transcription"})
    assert out[0]["session"]["type"] == "transcription" and fake.settings.create_response is False
    out = send(tr, type="session.update", session={"type": "realtime"})
    assert out[0]["session"]["type"] == "realtime" and fake.settings.create_response is True


def test_semantic_vad_eagerness_maps_onto_the_turn_detector() -> None:
    tr, fake = make()
    base = fake.settings.vad
    out = send(tr, type="session.update", session={"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad", "eagerness": "high", "interrupt_response": True}}}})
    td = out[0]["session"]["audio"]["input"]["turn_detection"]
    assert td == {"type": "semantic_vad", "eagerness": "high", "create_response": True,
                  "interrupt_response": True}
    high = fake.settings.vad
    assert high.turn_detector == "smart_turn" and high.min_silence_ms == base.min_silence_ms // 2
    assert high.smart_turn_max_silence_ms < base.smart_turn_max_silence_ms
    assert high.smart_turn_threshold < base.smart_turn_threshold
    send(tr, type="session.update", session={"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad", "eagerness": "low"}}}})
    low = fake.settings.vad
    assert low.min_silence_ms == 2 * base.min_silence_ms and low.smart_turn_max_silence_ms > base.smart_turn_max_silence_ms
    assert low.speculative_silence_ms <= low.min_silence_ms
    send(tr, type="session.update", session={"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad"}}}})  # auto: the server's own settings
    auto = fake.settings.vad
    assert (auto.turn_detector, auto.min_silence_ms, auto.smart_turn_max_silence_ms) == (
        "smart_turn", base.min_silence_ms, base.smart_turn_max_silence_ms)
    out = send(tr, type="session.update", session={"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "server_vad", "silence_duration_ms": 700}}}})
    assert fake.settings.vad.turn_detector == "silence" and fake.settings.vad.min_silence_ms == 700
    assert out[0]["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"


def test_noise_reduction_is_accepted_and_echoed() -> None:
    tr, _ = make()
    assert tr.opening()[0]["session"]["audio"]["input"]["noise_reduction"] is None
    out = send(tr, type="session.update", session={"type": "realtime", "audio": {"input": {
        "noise_reduction": {"type": "near_field"}}}})
    assert out[0]["session"]["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
    out = send(tr, type="session.update", session={"type": "realtime", "instructions": "x"})
    assert out[0]["session"]["audio"]["input"]["noise_reduction"] == {"type": "near_field"}  # kept
    out = send(tr, type="session.update", session={"type": "realtime", "audio": {"input": {"noise_reduction": None}}})
    assert out[0]["session"]["audio"]["input"]["noise_reduction"] is None


def test_idle_timeout_triggers_a_reply_after_the_last_one() -> None:
    now = [100.0]
    tr, fake = make(clock=lambda: now[0])
    out = send(tr, type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": {
        "type": "server_vad", "idle_timeout_ms": 5000}}}})
    assert out[0]["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"] == 5000
    assert tr.idle_due_in() is None  # it runs after a reply
    tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    fake.input_ms = 3000.0
    tr.session_event(se.ResponseDone("resp_1", "item_a1", "completed", "Hi", "Hi", 500))
    assert tr.idle_due_in() == 5.0
    now[0] += 4.9
    assert tr.idle_check() == [] and ("respond",) not in fake.calls
    now[0] += 0.2
    fake.input_ms = 8100.0
    out = tr.idle_check()
    assert [e["type"] for e in out] == ["input_audio_buffer.timeout_triggered", "input_audio_buffer.committed",
                                        "conversation.item.added", "conversation.item.done"]
    assert (out[0]["audio_start_ms"], out[0]["audio_end_ms"]) == (3000, 8100)
    assert out[0]["item_id"] == out[1]["item_id"] == out[2]["item"]["id"]
    assert fake.calls[-1] == ("respond",) and tr.idle_due_in() is None
    # Speech before the deadline stops the timer.
    tr.session_event(se.ResponseStarted("resp_2", "item_a2"))
    tr.session_event(se.ResponseDone("resp_2", "item_a2", "completed", "Hi", "Hi", 500))
    assert tr.idle_due_in() == 5.0
    tr.session_event(se.SpeechStarted(9000, "item_u3"))
    now[0] += 10
    assert tr.idle_due_in() is None and tr.idle_check() == []


def test_output_audio_buffer_clear_stops_the_reply() -> None:
    tr, fake = make()
    tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    fake.response_running = True
    (out,) = send(tr, type="output_audio_buffer.clear")
    assert out["type"] == "output_audio_buffer.cleared" and out["response_id"] == "resp_1"
    assert fake.calls[-1] == ("cancel",)


def test_text_only_replies_send_text_deltas_and_no_audio() -> None:
    tr, _ = make()
    out = send(tr, type="session.update", session={"type": "realtime", "output_modalities": ["text"]})
    assert out[0]["session"]["output_modalities"] == ["text"]
    out = tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    out += tr.session_event(se.ResponseTextDelta("resp_1", "item_a1", "Hi"))
    out += tr.session_event(se.ResponseAudio("resp_1", "item_a1", np.full(320, 0.1, np.float32), 16000))
    out += tr.session_event(se.ResponseDone("resp_1", "item_a1", "completed", "Hi", "Hi", 0))
    types = [e["type"] for e in out]
    assert "response.output_text.delta" in types and "response.output_text.done" in types
    assert not [t for t in types if "audio" in t], types
    assert out[-1]["response"]["output_modalities"] == ["text"]


def test_every_ga_server_event_validates_against_the_openai_sdk_types() -> None:
    # Clients parse server events with these types (the Agents SDK reports an event that
    # does not validate as an exception): every GA event we send must validate.
    from openai.types.realtime import RealtimeServerEvent
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
    now = [0.0]
    tr, fake = make(clock=lambda: now[0])
    out = tr.opening()
    out += send(tr, type="session.update", session={"type": "realtime", "audio": {"input": {
        "noise_reduction": {"type": "near_field"},
        "turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}}})
    out += tr.session_event(se.SpeechStarted(900, "item_u1"))
    out += tr.session_event(se.TranscriptPartial("item_u1", "hello", "there"))
    out += tr.session_event(se.SpeechStopped(2500, "item_u1"))
    out += tr.session_event(se.TranscriptFinal("item_u1", "hello there"))
    out += send(tr, type="response.create", response={"metadata": {"client_event_id": "x"}})
    out += tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    out += tr.session_event(se.ResponseTextDelta("resp_1", "item_a1", "Ahoy"))
    out += tr.session_event(se.ResponseAudio("resp_1", "item_a1", np.full(3200, 0.1, np.float32), 16000))
    out += tr.session_event(se.ResponseDone("resp_1", "item_a1", "completed", "Ahoy", "Ahoy", 200, None, 10, 2))
    out += send(tr, type="conversation.item.retrieve", item_id="item_u1")
    out += send(tr, type="conversation.item.retrieve", item_id="item_a1")
    out += send(tr, type="conversation.item.truncate", item_id="item_a1", content_index=0, audio_end_ms=100)
    out += send(tr, type="conversation.item.retrieve", item_id="item_a1")
    now[0] += 6
    out += tr.idle_check()
    out += send(tr, type="output_audio_buffer.clear")
    out += send(tr, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]})
    out += send(tr, type="conversation.item.retrieve", item_id="nope")
    out += send(tr, type="session.update", session={"type": "transcription"})
    tr2, _ = make(transcription_only=True)
    out += tr2.opening()
    kinds = {e["type"] for e in out}
    assert {"conversation.item.retrieved", "rate_limits.updated", "input_audio_buffer.timeout_triggered",
            "output_audio_buffer.cleared", "error", "response.done"} <= kinds, kinds
    for event in out:
        adapter.validate_python(event)


# ---------------------------------------------------------------- live server
@dataclass
class Running:
    state: ServerState
    port: int

    def url(self, path: str = "/v1/realtime") -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(api_key=KEY, base_url=f"http://127.0.0.1:{self.port}/v1",
                           websocket_base_url=f"ws://127.0.0.1:{self.port}/v1")


@pytest.fixture(scope="module")
async def server(engine_pool: EnginePool, models_config: ModelsConfig) -> AsyncIterator[Running]:
    cfg = load_config("configs/test.yaml", [
        f"models.cache_dir={models_config.cache_dir}", FAST_SPEECH,
        "llm.max_tokens=12",
        f"server.api_key={KEY}",
        "server.max_message_bytes=262144",
        # These tests upload each clip at once, faster than real time; the input-rate
        # test lowers it again for its own session.
        "server.input_burst_ms=60000",
    ])
    async with running_server(cfg, pool=engine_pool) as running:
        yield Running(running.state, running.port)


@pytest.fixture(scope="module")
def clip(speech_clips: list[Clip]) -> Clip:
    return min((c for c in speech_clips if c.name.startswith("sense")), key=lambda c: c.duration_s)


def b64_pcm24k(audio16k: np.ndarray) -> list[str]:
    """The clip as 100 ms audio/pcm chunks, plus a second of silence to end the turn."""
    audio = np.concatenate([resample(audio16k, 16000, 24000), np.zeros(24000, np.float32)])
    return [base64.b64encode(float_to_pcm16(audio[i:i + 2400])).decode() for i in range(0, audio.size, 2400)]


def kind(event: Any) -> str:
    return str(event["type"] if isinstance(event, dict) else event.type)


async def collect(recv: Callable[[], Any], until: Callable[[Any], bool], events: list[Any]) -> Any:
    async with asyncio.timeout(TIMEOUT):
        while True:
            event = await recv()
            events.append(event)
            if until(event):
                return event


def reply_audio(events: list[Any], delta_type: str = "response.output_audio.delta") -> bytes:
    return b"".join(base64.b64decode(e.delta) for e in events if kind(e) == delta_type)


@pytest.mark.engines
async def test_sdk_spoken_exchange_with_server_vad(server: Running, clip: Clip) -> None:
    async with server.client().realtime.connect(model="gpt-realtime") as conn:
        events: list[Any] = []
        assert kind(await conn.recv()) == "session.created"
        await conn.session.update(session={
            "type": "realtime", "instructions": "Be brief.", "output_modalities": ["audio"],
            "max_output_tokens": 6,  # the test LLM's nonsense tokens are long to speak
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                "turn_detection": {"type": "server_vad", "silence_duration_ms": 400}},
                      "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin"}}})
        updated = await collect(conn.recv, lambda e: kind(e) == "session.updated", events)
        assert updated.session.audio.input.turn_detection.silence_duration_ms == 400
        for chunk in b64_pcm24k(clip.audio):
            await conn.input_audio_buffer.append(audio=chunk)
        done = await collect(conn.recv, lambda e: kind(e) == "response.done", events)
        types = [kind(e) for e in events]
        for expected in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "conversation.item.added",
                         "conversation.item.input_audio_transcription.completed", "response.created",
                         "response.output_item.added", "response.output_audio.delta",
                         "response.output_audio_transcript.delta", "response.output_audio.done",
                         "response.output_audio_transcript.done", "response.output_item.done"):
            assert expected in types, (expected, types)
        assert types.index("input_audio_buffer.committed") < types.index(
            "conversation.item.input_audio_transcription.completed")
        assert types.index("response.created") < types.index("response.output_audio.delta")
        assert not any(kind(e) == "error" for e in events), events
        heard = next(e for e in events if kind(e) == "conversation.item.input_audio_transcription.completed")
        assert wer(clip.text, heard.transcript) <= 0.25, (clip.text, heard.transcript)
        assert done.response.status in ("completed", "incomplete"), done.response
        pcm = pcm16_to_float(reply_audio(events))
        assert pcm.size > 2400 and dbfs(pcm) > -40, (pcm.size, dbfs(pcm))
        text = "".join(e.delta for e in events if kind(e) == "response.output_audio_transcript.delta")
        assert text and done.response.output[0].content[0].transcript == text

        # The caller heard none of it: the stored reply goes (the item leaves the history).
        item_id = done.response.output[0].id
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=0)
        truncated = await collect(conn.recv, lambda e: kind(e) in ("conversation.item.truncated", "error"), events)
        assert kind(truncated) == "conversation.item.truncated" and truncated.item_id == item_id
        (session,) = server.state.sessions.values()
        assert all(m.item_id != item_id for m in session.item_history())


@pytest.mark.engines
async def test_sdk_manual_commit_cancel_and_truncate(server: Running, clip: Clip) -> None:
    async with server.client().realtime.connect(model="gpt-realtime") as conn:
        events: list[Any] = []
        await collect(conn.recv, lambda e: kind(e) == "session.created", events)
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        updated = await collect(conn.recv, lambda e: kind(e) == "session.updated", events)
        assert updated.session.audio.input.turn_detection is None
        for chunk in b64_pcm24k(clip.audio):
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()
        heard = await collect(conn.recv, lambda e: kind(e).endswith("transcription.completed"), events)
        assert [kind(e) for e in events[2:4]] == ["input_audio_buffer.committed", "conversation.item.added"]
        assert wer(clip.text, heard.transcript) <= 0.25, (clip.text, heard.transcript)
        assert not any(kind(e) == "response.created" for e in events)  # no reply unless asked

        await conn.response.create()
        first = await collect(conn.recv, lambda e: kind(e) == "response.output_audio.delta", events)
        await conn.response.cancel()
        done = await collect(conn.recv, lambda e: kind(e) == "response.done", events)
        assert done.response.id == first.response_id
        assert (done.response.status, done.response.status_details.reason) == ("cancelled", "client_cancelled")
        sent_ms = len(reply_audio(events)) / 2 / 24
        # Truncate to what was sent; asking for more than that is an error.
        await conn.conversation.item.truncate(item_id=first.item_id, content_index=0,
                                              audio_end_ms=int(sent_ms) + 500)
        err = await collect(conn.recv, lambda e: kind(e) in ("error", "conversation.item.truncated"), events)
        assert kind(err) == "error" and err.error.param == "audio_end_ms"
        await conn.conversation.item.truncate(item_id=first.item_id, content_index=0, audio_end_ms=int(sent_ms))
        ok = await collect(conn.recv, lambda e: kind(e) in ("error", "conversation.item.truncated"), events)
        assert kind(ok) == "conversation.item.truncated", ok
        assert [e for e in events if kind(e) == "error"] == [err]
        assert [e.response.id for e in events if kind(e) == "response.created"] == [done.response.id]


@pytest.mark.engines
async def test_barge_in_reports_speech_then_the_cancelled_reply(server: Running, clip: Clip) -> None:
    async with server.client().realtime.connect(model="gpt-realtime") as conn:
        events: list[Any] = []
        await collect(conn.recv, lambda e: kind(e) == "session.created", events)
        chunks = b64_pcm24k(clip.audio)
        for chunk in chunks:
            await conn.input_audio_buffer.append(audio=chunk)
        first = await collect(conn.recv, lambda e: kind(e) == "response.created", events)
        mark = len(events)
        for chunk in chunks:  # the caller talks over the reply
            await conn.input_audio_buffer.append(audio=chunk)
        done = await collect(conn.recv, lambda e: kind(e) == "response.done"
                             and e.response.id == first.response.id, events)
        assert (done.response.status, done.response.status_details.reason) == ("cancelled", "turn_detected")
        after = [kind(e) for e in events[mark:]]
        assert "input_audio_buffer.speech_started" in after
        assert after.index("input_audio_buffer.speech_started") < after.index("response.done")
        # The second turn gets its own reply (cancelled here: its length is not the point).
        second = await collect(conn.recv, lambda e: kind(e) == "response.created", events)
        await conn.response.cancel()
        done = await collect(conn.recv, lambda e: kind(e) == "response.done", events)
        assert done.response.id == second.response.id != first.response.id


async def raw(server: Running, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    return websockets.connect(server.url(), additional_headers=headers or {"Authorization": f"Bearer {KEY}"},
                              max_size=None, **kw)


async def next_of(ws: Any, *types: str) -> dict[str, Any]:
    async with asyncio.timeout(TIMEOUT):
        while True:
            event = json.loads(await ws.recv())
            if event["type"] in types:
                return event  # type: ignore[no-any-return]


@pytest.mark.engines
async def test_bad_input_gets_openai_shaped_errors_and_the_session_goes_on(server: Running) -> None:
    cases: list[tuple[str | bytes, str, str | None, str | None]] = [
        ("{not json", "invalid_event", None, None),
        (json.dumps({"type": "bogus.event", "event_id": "e1"}), "unknown_event", "e1", "type"),
        (json.dumps({"type": "input_audio_buffer.append", "event_id": "e2", "audio": "@@not base64@@"}),
         "invalid_audio", "e2", "audio"),
        (json.dumps({"type": "input_audio_buffer.append", "event_id": "e3", "audio": "AAAA"}),
         "invalid_audio", "e3", "audio"),  # 3 bytes: not PCM16
        (json.dumps({"type": "session.update", "event_id": "e4",
                     "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/opus"}}}}}),
         "unsupported_format", "e4", "session.audio.input.format"),
        (json.dumps({"type": "session.update", "event_id": "e5",
                     "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm",
                                                                                    "rate": 16000}}}}}),
         "unsupported_format", "e5", "session.audio.input.format"),
        (json.dumps({"type": "input_audio_buffer.append", "event_id": "e6", "audio": "A" * 300_000}),
         "message_too_large", "e6", None),
        (json.dumps({"type": "conversation.item.truncate", "event_id": "e7", "item_id": "x"}),
         "invalid_event", "e7", "audio_end_ms"),
        (json.dumps({"type": "conversation.item.truncate", "event_id": "e8", "item_id": "nope",
                     "content_index": 0, "audio_end_ms": 10}), "unknown_item", "e8", "item_id"),
        (json.dumps({"type": "input_audio_buffer.commit", "event_id": "e9"}),
         "input_audio_buffer_commit_empty", "e9", None),
        (json.dumps({"type": "response.cancel", "event_id": "e10"}), "response_cancel_not_active", "e10", None),
        (b"\x00\x01", "invalid_event", None, None),
        ("[" * 100_000 + "]" * 100_000, "invalid_event", None, None),
        (json.dumps({"type": "input_audio_buffer.append", "event_id": "e11",
                     "audio": base64.b64encode(bytes(2 * 24_000 * 2)).decode()}),  # 2 s in one message
         "message_too_large", "e11", "audio"),
        (json.dumps({"type": "conversation.item.create", "event_id": "e12", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "a" * 50_000}]}}),
         "text_too_long", "e12", None),
    ]
    async with await raw(server) as ws:
        await next_of(ws, "session.created")
        for message, code, event_id, param in cases:
            await ws.send(message)
            event = await next_of(ws, "error")
            assert set(event) == {"type", "event_id", "error"}, event
            err = event["error"]
            assert (err["type"], err["code"], err["event_id"], err["param"]) == (
                "invalid_request_error", code, event_id, param), (message[:80], event)
            assert err["message"]
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        assert (await next_of(ws, "input_audio_buffer.cleared", "error"))["type"] == "input_audio_buffer.cleared"


@pytest.mark.engines
async def test_client_closing_while_errors_are_sent_logs_no_traceback(server: Running) -> None:
    # The live fuzzer's find: the client closes while the server still sends its replies;
    # a send to a gone client is the end of the session, never "Exception in ASGI application".
    with server_errors() as errors:
        item = json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
        for _ in range(10):  # the close races the sends: repeat to meet more interleavings
            async with await raw(server) as ws:
                # Replies from both directions at once: the reader's errors and the
                # session's events (items added, a reply) that the writer sends.
                await ws.send(json.dumps({"type": "response.create"}))
                for _ in range(25):
                    await ws.send("{")
                    await ws.send(item)
            await asyncio.sleep(0.02)
        async with asyncio.timeout(TIMEOUT):
            while server.state.sessions:
                await asyncio.sleep(0.05)
        async with await raw(server) as ws:  # and the server still serves
            await next_of(ws, "session.created")
            await ws.send("{")
            assert (await next_of(ws, "error"))["error"]["code"] == "invalid_event"
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]


@pytest.mark.engines
async def test_auth_header_or_subprotocol_and_refusal(server: Running) -> None:
    async with await raw(server, headers={"X": "y"}) as ws:
        event = json.loads(await ws.recv())
        assert event["type"] == "error" and event["error"]["code"] == "unauthorized"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
    async with await raw(server, headers={"X": "y"}, subprotocols=protocols) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(await ws.recv())["type"] == "session.created"


@pytest.mark.engines
async def test_beta_client_with_g711_both_ways(server: Running, clip: Clip) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "OpenAI-Beta": "realtime=v1"}
    async with await raw(server, headers=headers) as ws:
        created = await next_of(ws, "session.created")
        assert created["session"]["input_audio_format"] == "pcm16"
        await ws.send(json.dumps({"type": "session.update", "session": {
            "input_audio_format": "g711_ulaw", "output_audio_format": "g711_ulaw", "turn_detection": None,
            "modalities": ["audio", "text"], "voice": "alloy"}}))
        updated = await next_of(ws, "session.updated")
        assert updated["session"]["output_audio_format"] == "g711_ulaw" and updated["session"]["turn_detection"] is None
        audio8k = float_to_pcm16(np.concatenate([resample(clip.audio, 16000, 8000), np.zeros(4000, np.float32)]))
        ulaw = g711.encode("audio/pcmu", audio8k)
        for i in range(0, len(ulaw), 800):
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(ulaw[i:i + 800]).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        created_item = await next_of(ws, "conversation.item.created")
        heard = await next_of(ws, "conversation.item.input_audio_transcription.completed")
        assert heard["item_id"] == created_item["item"]["id"]
        assert wer(clip.text, heard["transcript"]) <= 0.35, (clip.text, heard["transcript"])  # 8 kHz telephony
        await ws.send(json.dumps({"type": "response.create"}))
        seen: list[dict[str, Any]] = []
        async with asyncio.timeout(TIMEOUT):
            while not seen or seen[-1]["type"] != "response.done":
                seen.append(json.loads(await ws.recv()))
                if sum(e["type"] == "response.audio.delta" for e in seen) == 25:  # 0.5 s is plenty
                    await ws.send(json.dumps({"type": "response.cancel"}))
        types = {e["type"] for e in seen}
        assert "error" not in types, seen
        assert sum(e["type"] == "response.created" for e in seen) == 1
        assert {"response.audio.delta", "response.audio_transcript.delta", "response.audio.done",
                "conversation.item.created"} <= types, types
        assert not types & {"response.output_audio.delta", "conversation.item.added"}
        pcm = pcm16_to_float(g711.decode("audio/pcmu", b"".join(
            base64.b64decode(e["delta"]) for e in seen if e["type"] == "response.audio.delta")))
        assert pcm.size > 800 and dbfs(pcm) > -40


@pytest.mark.engines
async def test_transcription_session_and_text_only_replies(server: Running, clip: Clip) -> None:
    # ?intent=transcription: speech in, transcripts out, never a reply.
    async with websockets.connect(server.url() + "?intent=transcription",
                                  additional_headers={"Authorization": f"Bearer {KEY}"}, max_size=None) as ws:
        created = await next_of(ws, "session.created")
        assert created["session"]["type"] == "transcription", created
        for chunk in b64_pcm24k(clip.audio):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        seen: list[dict[str, Any]] = []
        async with asyncio.timeout(TIMEOUT):
            while not seen or seen[-1]["type"] != "conversation.item.input_audio_transcription.completed":
                seen.append(json.loads(await ws.recv()))
        assert wer(clip.text, seen[-1]["transcript"]) <= 0.25, seen[-1]
        await ws.send(json.dumps({"type": "response.create", "event_id": "r1"}))
        err = await next_of(ws, "error", "response.created")
        assert err["type"] == "error" and err["error"]["event_id"] == "r1", err
    # output_modalities ["text"]: text deltas, no audio at all, metadata echoed.
    async with await raw(server) as ws:
        await next_of(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                        "output_modalities": ["text"]}}))
        await next_of(ws, "session.updated")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}}))
        await ws.send(json.dumps({"type": "response.create", "response": {"metadata": {"topic": "greeting"}}}))
        seen = []
        async with asyncio.timeout(TIMEOUT):
            while not seen or seen[-1]["type"] != "response.done":
                seen.append(json.loads(await ws.recv()))
        types = [e["type"] for e in seen]
        assert "response.output_text.delta" in types and not [t for t in types if "audio" in t], types
        assert seen[-1]["response"]["metadata"] == {"topic": "greeting"}
        assert seen[-1]["response"]["output"][0]["content"][0]["type"] == "output_text"


@pytest.mark.engines
async def test_probe_speaks_realtime(server: Running, clip: Clip) -> None:
    probe_clip = load_clip(clip.path, 16000)
    started = time.monotonic()
    cfg = ProbeConfig(url=server.url(), clips=(probe_clip,), turns=1, protocol="realtime", token=KEY,
                      timeout_s=TIMEOUT, start_fields={"max_tokens": 2})
    (record,) = await run_level(cfg, 1)
    assert record.status == "ok", record
    assert wer(clip.text, record.transcript) <= 0.25, record.transcript
    assert record.voice_to_voice_ms is not None and record.voice_to_voice_ms < 1000 * (time.monotonic() - started)


def test_events_beyond_the_control_rate_are_refused_and_audio_is_not_counted() -> None:
    clock = StepClock()
    tr, fake = make(control_gate=edge.ControlGate(rate=2.0, burst=3, clock=clock))
    for _ in range(3):
        assert send(tr, type="input_audio_buffer.clear")[0]["type"] == "input_audio_buffer.cleared"
    (err,) = send(tr, type="input_audio_buffer.clear", event_id="e4")
    assert (err["type"], err["error"]["code"], err["error"]["event_id"]) == ("error", "message_rate_exceeded", "e4")
    chunk = base64.b64encode(bytes(480)).decode()
    for _ in range(10):  # audio has its own gate
        assert send(tr, type="input_audio_buffer.append", audio=chunk) == []
    clock.t += 0.5  # one token back
    assert send(tr, type="input_audio_buffer.clear")[0]["type"] == "input_audio_buffer.cleared"
    (err,) = send(tr, type="input_audio_buffer.clear")
    assert err["error"]["code"] == "message_rate_exceeded"
    assert fake.calls.count(("clear",)) == 4  # a refused event does nothing


@pytest.mark.engines
async def test_audio_faster_than_real_time_is_refused(server: Running) -> None:
    cfg = server.state.cfg.server
    old, cfg.input_burst_ms = cfg.input_burst_ms, 2000
    try:
        async with await raw(server) as ws:
            await next_of(ws, "session.created")
            chunk = base64.b64encode(bytes(2 * 2400)).decode()  # 100 ms at 24 kHz
            sending = time.monotonic()
            for i in range(40):  # 4 s at once: the 2 s burst passes, then refusals
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "event_id": f"a{i}", "audio": chunk}))
            err = (await next_of(ws, "error"))["error"]
            assert (err["code"], err["param"]) == ("input_rate_exceeded", "audio"), err
            assert int(err["event_id"][1:]) >= 19  # the first 2 s were taken
            (session,) = server.state.sessions.values()
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            await next_of(ws, "input_audio_buffer.cleared")  # the session goes on
            # The burst and what the rate (1.1x real time) refilled while the loop took them.
            allowed = 2000 + 1100 * (time.monotonic() - sending) + 100
            assert session.input_ms <= min(allowed, 3500), (session.input_ms, allowed)
    finally:
        cfg.input_burst_ms = old


@pytest.mark.engines
async def test_capacity_refusal_and_foreign_origin(server: Running) -> None:
    cfg = server.state.cfg.server
    old, cfg.max_sessions = cfg.max_sessions, 1
    server.state.siblings.opened(None)  # a call in progress: the one slot is taken
    try:
        async with await raw(server) as ws:
            event = json.loads(await ws.recv())
            assert event["type"] == "error" and event["error"]["code"] == "capacity_exceeded"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013  # try again later
    finally:
        server.state.siblings.closed(None)
        cfg.max_sessions = old
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with await raw(server, origin="https://evil.example"):
            pass
    assert refused.value.response.status_code == 403
