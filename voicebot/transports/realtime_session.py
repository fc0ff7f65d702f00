"""The Realtime translator: client events -> Session calls, SessionEvents -> server events.

Plain synchronous code, no I/O: the transport hands it each text frame
(:meth:`RealtimeTranslator.client_message`) and each session event
(:meth:`RealtimeTranslator.session_event`) and sends whatever list comes back. It keeps
what the wire needs and the session does not: item/response ids in wire order, the
audio formats, the naming family (GA or beta), the reply transcript sent so far.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import time
from collections.abc import Collection
from typing import Any, Protocol

from pydantic import ValidationError

from voicebot.errors import VoicebotError
from voicebot.server import edge
from voicebot.session import events as se
from voicebot.session.settings import SessionSettings
from voicebot.transports import g711
from voicebot.transports import realtime_events as rt
from voicebot.transports.realtime_replies import Replies, Wire

_MIN_COMMIT_MS = 100.0  # OpenAI refuses to commit less audio than this
_SERVER_ERRORS = frozenset({"internal_error", "engine_error", "capacity_exceeded", "not_ready", "draining",
                            "model_unavailable", "slow_consumer"})
_SETTING_PARAMS = {"system_prompt": "instructions", "vad": "turn_detection", "speed": "speed",
                   "voice": "voice", "max_tokens": "max_output_tokens"}


class _Conversation(Protocol):
    def delete(self, item_id: str) -> bool: ...


class SessionPort(Protocol):
    """The part of :class:`voicebot.session.session.Session` the translator drives."""

    settings: SessionSettings

    @property
    def conversation(self) -> _Conversation: ...

    def push_audio(self, audio: bytes, sample_rate: int) -> None: ...
    def commit_input(self) -> str: ...
    def clear_input(self) -> None: ...
    def add_text(self, role: str, text: str, item_id: str | None = None) -> str: ...
    def create_response(self) -> str: ...
    def cancel_response(self) -> bool: ...
    def truncate(self, item_id: str, audio_end_ms: int) -> str | None: ...
    def set_played(self, ms: int) -> None: ...
    def update_settings(self, **changes: object) -> None: ...


class RealtimeTranslator:
    def __init__(self, session: SessionPort, *, session_id: str, model: str, beta: bool = False,
                 voices: Collection[str] | None = None, audio_gate: edge.AudioGate | None = None) -> None:
        self.session = session
        self.audio_gate = audio_gate  # wire limits on caller audio (None: unlimited, for tests)
        self.wire = Wire(fam=rt.BETA if beta else rt.GA)
        self.replies = Replies(self.wire, self.view, self._link)
        self.id, self.model = session_id, model
        self.voices = voices
        self.voice_name = session.settings.voice or "alloy"
        self.transcription: dict[str, Any] | None = {"model": "whisper", "language": session.settings.language}
        self.default_max_tokens = session.settings.max_tokens
        self._event_ids = itertools.count(1)
        self._last_item: str | None = None
        self._partials: dict[str, str] = {}  # open user turn -> transcript sent as deltas
        self._turn_ms: dict[str, float] = {}  # user turn -> audio ms at its start
        self._buffered_ms = 0.0
        self._barge = False
        self._held: list[dict[str, Any]] | None = None  # a barged reply's response.done

    # ----------------------------------------------------------------- helpers
    @property
    def fam(self) -> rt.Family:
        return self.wire.fam

    def _link(self, item_id: str) -> str | None:
        prev, self._last_item = self._last_item, item_id
        return prev

    def _out(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"type": e["type"], "event_id": f"event_{next(self._event_ids)}", **e} for e in events]

    def view(self) -> rt.SessionView:
        s = self.session.settings
        td = None
        if s.turn_detection:
            td = {"type": "server_vad", "threshold": s.vad.threshold,
                  "prefix_padding_ms": s.vad.prefix_padding_ms, "silence_duration_ms": s.vad.min_silence_ms,
                  "create_response": s.create_response, "interrupt_response": s.interrupt_response,
                  "idle_timeout_ms": None}
        w = self.wire
        return rt.SessionView(self.id, self.model, s.system_prompt, self.voice_name, s.speed, w.in_fmt,
                              w.out_fmt, td, self.transcription, w.text_only, s.max_tokens)

    def error(self, exc: VoicebotError, client_event_id: str | None = None) -> list[dict[str, Any]]:
        kind = "server_error" if exc.code in _SERVER_ERRORS else "invalid_request_error"
        return self._out([rt.error(exc.code, str(exc), client_event_id=client_event_id,
                                   param=getattr(exc, "param", None), kind=kind)])

    def opening(self) -> list[dict[str, Any]]:
        return self._out([{"type": "session.created", "session": rt.session_object(self.fam, self.view())}])

    # ----------------------------------------------------------- client events
    def client_message(self, text: str) -> list[dict[str, Any]]:
        """One text frame from the client -> replies; bad input becomes an error event."""
        event_id = None
        try:
            data = rt.load_json(text)
            event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
            return self._out(self._apply(rt.validate_client_event(data)))
        except VoicebotError as exc:
            return self.error(exc, event_id)

    def _apply(self, ev: rt.ClientEvent) -> list[dict[str, Any]]:
        match ev:
            case rt.SessionUpdate():
                return self._update(ev.session)
            case rt.AudioAppend():
                return self._append(ev.audio)
            case rt.AudioCommit():
                return self._commit()
            case rt.AudioClear():
                self.session.clear_input()
                self._buffered_ms = 0.0
                return [{"type": "input_audio_buffer.cleared"}]
            case rt.ItemCreate():
                return self._create_item(ev.item)
            case rt.ItemTruncate():
                return self._truncate(ev.item_id, ev.content_index, ev.audio_end_ms)
            case rt.ItemDelete():
                if not self.session.conversation.delete(ev.item_id):
                    raise rt.RealtimeRequestError(f"no item {edge.clip(ev.item_id)}", code="unknown_item", param="item_id")
                return [{"type": "conversation.item.deleted", "item_id": ev.item_id}]
            case rt.ResponseCreate():
                if self.replies.current is not None:
                    raise rt.RealtimeRequestError(
                        f"response {self.replies.current.id} is still in progress; cancel it or wait for response.done",
                        code="conversation_already_has_active_response")
                self.session.create_response()
                return []  # response.created follows from the session's ResponseStarted
            case rt.ResponseCancel():
                if not self.session.cancel_response():
                    raise rt.RealtimeRequestError("no response to cancel", code="response_cancel_not_active")
                return []  # response.done (cancelled) follows from the session
        raise AssertionError(ev)  # pragma: no cover: the union is exhaustive

    def _update(self, cfg: rt.SessionIn) -> list[dict[str, Any]]:
        given = cfg.model_fields_set
        if not self.fam.beta and cfg.type is None and "audio" not in given and given & rt.BETA_SESSION_FIELDS:
            self.wire.fam = rt.BETA  # an older client: answer in the names it knows
        audio = cfg.audio or rt.AudioIn.model_validate({})
        a_in = audio.input or rt.AudioInputIn.model_validate({})
        a_out = audio.output or rt.AudioOutputIn.model_validate({})
        in_fmt, out_fmt, changes = self.wire.in_fmt, self.wire.out_fmt, dict[str, object]()
        if a_in.format is not None:
            in_fmt = rt.format_from_ga(a_in.format, "session.audio.input.format")
        if cfg.input_audio_format is not None:
            in_fmt = rt.format_from_beta(cfg.input_audio_format, "session.input_audio_format")
        if a_out.format is not None:
            out_fmt = rt.format_from_ga(a_out.format, "session.audio.output.format")
        if cfg.output_audio_format is not None:
            out_fmt = rt.format_from_beta(cfg.output_audio_format, "session.output_audio_format")
        if cfg.instructions is not None:
            changes["system_prompt"] = cfg.instructions
        voice = a_out.voice if a_out.voice is not None else cfg.voice
        if voice is not None:
            name = voice if isinstance(voice, str) else str(voice.get("id", ""))
            if name in rt.OPENAI_VOICES:
                changes["voice"] = None  # our TTS's default voice stands in for OpenAI's
            elif self.voices is not None and name not in self.voices:
                raise rt.RealtimeRequestError(f"unknown voice {edge.clip(name)}", code="invalid_value", param="session.voice")
            else:
                changes["voice"] = name
        speed = a_out.speed if a_out.speed is not None else cfg.speed
        if speed is not None:
            changes["speed"] = speed
        if "turn_detection" in a_in.model_fields_set:
            changes.update(self._turn_detection(a_in.turn_detection))
        elif "turn_detection" in given:
            changes.update(self._turn_detection(cfg.turn_detection))
        transcription = self.transcription  # echoed only: our one ASR always transcribes
        if "transcription" in a_in.model_fields_set:
            transcription = a_in.transcription
        elif "input_audio_transcription" in given:
            transcription = cfg.input_audio_transcription
        tokens = cfg.max_output_tokens if cfg.max_output_tokens is not None else cfg.max_response_output_tokens
        if tokens is not None:
            changes["max_tokens"] = self.default_max_tokens if tokens == "inf" else tokens
        modalities = cfg.output_modalities or cfg.modalities
        try:
            self.session.update_settings(**changes)
        except (ValidationError, ValueError, TypeError) as exc:
            loc = exc.errors()[0]["loc"] if isinstance(exc, ValidationError) else ()
            param = "session." + _SETTING_PARAMS.get(str(loc[0]), str(loc[0])) if loc else None
            raise rt.RealtimeRequestError(f"invalid session.update: {exc}", param=param) from None
        self.wire.in_fmt, self.wire.out_fmt, self.transcription = in_fmt, out_fmt, transcription
        if modalities is not None:
            self.wire.text_only = "audio" not in modalities
        if isinstance(voice, str):
            self.voice_name = voice
        return [{"type": "session.updated", "session": rt.session_object(self.fam, self.view())}]

    def _turn_detection(self, td: rt.TurnDetectionIn | None) -> dict[str, object]:
        if td is None:  # OpenAI: no turn detection means no automatic replies either
            return {"turn_detection": False, "create_response": False}
        s = self.session.settings
        vad: dict[str, object] = {}
        if td.threshold is not None:
            vad["threshold"] = td.threshold
        if td.prefix_padding_ms is not None:
            vad["prefix_padding_ms"] = td.prefix_padding_ms
        if td.silence_duration_ms is not None:
            vad["min_silence_ms"] = td.silence_duration_ms
            # Speculation must start before the turn ends to be worth anything.
            vad["speculative_silence_ms"] = min(s.vad.speculative_silence_ms, td.silence_duration_ms // 2)
        # A turn_detection object replaces the previous one: unset flags take OpenAI's default.
        return {"turn_detection": True, "vad": s.vad.model_copy(update=vad),
                "create_response": td.create_response is not False,
                "interrupt_response": td.interrupt_response is not False}

    def _append(self, audio_b64: str) -> list[dict[str, Any]]:
        try:
            raw = base64.b64decode(audio_b64, validate=True)
        except (binascii.Error, ValueError):
            raise rt.RealtimeRequestError("audio is not valid base64", code="invalid_audio", param="audio") from None
        fmt = self.wire.in_fmt
        if fmt == "audio/pcm":
            if len(raw) % 2:
                raise rt.RealtimeRequestError("audio/pcm needs an even number of bytes (PCM16)",
                                              code="invalid_audio", param="audio")
            pcm, rate = raw, rt.PCM_RATE
        else:
            pcm, rate = g711.decode(fmt, raw), g711.RATE
        if pcm and self.audio_gate is not None:
            try:
                self.audio_gate.check(len(pcm) // 2, rate)
            except VoicebotError as exc:
                raise rt.RealtimeRequestError(str(exc), code=exc.code, param="audio") from None
        if pcm:
            self.session.push_audio(pcm, rate)
            self._buffered_ms += 1000.0 * len(pcm) / 2 / rate
        return []

    def _commit(self) -> list[dict[str, Any]]:
        if self._buffered_ms < _MIN_COMMIT_MS:
            raise rt.RealtimeRequestError(
                f"buffer too small: {self._buffered_ms:.0f} ms of audio; commit at least {_MIN_COMMIT_MS:.0f} ms",
                code="input_audio_buffer_commit_empty")
        item_id = self.session.commit_input()
        self._turn_ms[item_id] = self._buffered_ms
        self._buffered_ms = 0.0
        return self._user_turn_committed(item_id)

    def _user_turn_committed(self, item_id: str) -> list[dict[str, Any]]:
        prev = self._link(item_id)
        return [{"type": "input_audio_buffer.committed", "previous_item_id": prev, "item_id": item_id},
                {"type": self.fam.item_added, "previous_item_id": prev, "item": rt.user_audio_item(item_id, None)}]

    def _create_item(self, item: rt.ItemIn) -> list[dict[str, Any]]:
        if any(p.audio for p in item.content):
            raise rt.RealtimeRequestError("audio content in conversation.item.create is not supported; "
                                          "use input_audio_buffer.append", code="invalid_value", param="item.content")
        text = " ".join(t for p in item.content if (t := p.text if p.text is not None else p.transcript))
        if not text.strip():
            raise rt.RealtimeRequestError("the item has no text", code="invalid_value", param="item.content")
        item_id = self.session.add_text(item.role, text, item.id)
        prev = self._link(item_id)
        body = rt.text_item(self.fam, item_id, item.role, text)
        out = [{"type": self.fam.item_added, "previous_item_id": prev, "item": body}]
        if self.fam.item_done:
            out.append({"type": self.fam.item_done, "previous_item_id": prev, "item": body})
        return out

    def _truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> list[dict[str, Any]]:
        reply = self.replies.current
        sent = self.replies.sent_ms(item_id)
        if sent is not None and audio_end_ms > sent + 1:
            raise rt.RealtimeRequestError(f"audio_end_ms {audio_end_ms} is beyond the {sent:.0f} ms of audio sent",
                                          code="invalid_value", param="audio_end_ms")
        if reply is not None and reply.item_id == item_id:
            # Truncating the reply still playing: the caller stopped listening, so stop it.
            self.session.set_played(audio_end_ms)
            self.session.cancel_response()
        if self.session.truncate(item_id, audio_end_ms) is None:
            raise rt.RealtimeRequestError(f"no assistant audio item {edge.clip(item_id)} to truncate",
                                          code="unknown_item", param="item_id")
        return [{"type": "conversation.item.truncated", "item_id": item_id,
                 "content_index": content_index, "audio_end_ms": audio_end_ms}]

    # ---------------------------------------------------------- session events
    def session_event(self, event: se.SessionEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._held is not None and not isinstance(event, se.SpeechStarted):
            out, self._held = self._out(self._held), None  # never lose a response.done
        return out + self._out(self._render(event))

    def _render(self, event: se.SessionEvent) -> list[dict[str, Any]]:
        vad = self.session.settings.vad
        match event:
            case se.SpeechStarted(audio_ms=ms, item_id=item_id):
                self._partials[item_id] = ""
                self._turn_ms[item_id] = float(ms)
                start = max(0, ms - vad.prefix_padding_ms - vad.min_speech_ms)
                out = [{"type": "input_audio_buffer.speech_started", "audio_start_ms": start, "item_id": item_id}]
                # OpenAI reports the speech first, then the reply it cancelled.
                held, self._held = self._held or [], None
                return out + held
            case se.SpeechStopped(audio_ms=ms, item_id=item_id):
                self._buffered_ms = 0.0
                self._turn_ms[item_id] = ms - self._turn_ms.get(item_id, ms)
                end = max(0, ms - vad.min_silence_ms)
                return [{"type": "input_audio_buffer.speech_stopped", "audio_end_ms": end, "item_id": item_id},
                        *self._user_turn_committed(item_id)]
            case se.TranscriptPartial(item_id=item_id, confirmed=confirmed):
                sent = self._partials.get(item_id)
                if sent is None or not confirmed.startswith(sent) or not confirmed[len(sent):].strip():
                    return []  # deltas only append: tentative or revised text waits for the final
                self._partials[item_id] = confirmed
                return [self._transcript_delta(item_id, confirmed[len(sent):])]
            case se.TranscriptFinal(item_id=item_id, text=text):
                return self._transcript_final(item_id, text)
            case se.ResponseStarted(response_id=rid, item_id=item_id):
                return self.replies.start(rid, item_id)
            case se.ResponseTextDelta():
                return self.replies.text(event)
            case se.ResponseAudio():
                return self.replies.audio(event)
            case se.ResponseDone():
                out = self.replies.finish(event)
                if event.status == "interrupted" and self._barge:
                    self._barge = False
                    self._held, out = out, []  # sent after the speech_started that caused it
                return out
            case se.BargeIn():
                self._barge = True
                return []
            case se.ErrorEvent(code=code):
                kind = "server_error" if code in _SERVER_ERRORS else "invalid_request_error"
                return [rt.error(code, event.message, client_event_id=event.event_id, kind=kind)]
            case se.Dtmf(digit=digit):
                return [{"type": "input_audio_buffer.dtmf_event_received", "event": digit,
                         "received_at": int(time.time())}]
        return []  # TurnTimings, ResponseAudioStarted: nothing on this wire

    def _transcript_delta(self, item_id: str, delta: str) -> dict[str, Any]:
        return {"type": "conversation.item.input_audio_transcription.delta", "item_id": item_id,
                "content_index": 0, "delta": delta}

    def _transcript_final(self, item_id: str, text: str) -> list[dict[str, Any]]:
        sent = self._partials.pop(item_id, "")
        out = []
        if text.startswith(sent) and text[len(sent):].strip():
            out.append(self._transcript_delta(item_id, text[len(sent):]))
        seconds = round(self._turn_ms.pop(item_id, 0.0) / 1000.0, 3)
        out.append({"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                    "content_index": 0, "transcript": text, "usage": {"type": "duration", "seconds": seconds}})
        if self.fam.item_done:
            out.append({"type": self.fam.item_done, "previous_item_id": None,
                        "item": rt.user_audio_item(item_id, text)})
        return out
