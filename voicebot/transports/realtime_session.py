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
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any, Protocol

from pydantic import ValidationError

from voicebot.errors import VoicebotError
from voicebot.server import edge
from voicebot.session import events as se
from voicebot.session.response import ResponseOptions
from voicebot.session.settings import SessionSettings
from voicebot.tools.spec import ToolChoice, ToolError, ToolSpec
from voicebot.transports import realtime_events as rt
from voicebot.transports import realtime_tools
from voicebot.transports.realtime_replies import Replies, Wire
from voicebot.wire import g711

_MIN_COMMIT_MS = 100.0  # OpenAI refuses to commit less audio than this
_SERVER_ERRORS = frozenset({"internal_error", "engine_error", "capacity_exceeded", "not_ready", "draining",
                            "model_unavailable", "slow_consumer"})
_SETTING_PARAMS = {"system_prompt": "instructions", "vad": "turn_detection", "speed": "speed",
                   "voice": "voice", "max_tokens": "max_output_tokens"}
# Items a client can still retrieve (conversation.item.retrieve): the most recent ones.
# Clients retrieve the item they just heard about; older ones fall out of this memory.
_MAX_ITEMS = 128
_MAX_METADATA = 16  # OpenAI: up to 16 key/value pairs, keys <= 64 and values <= 512 chars
# Events that carry a whole item: the latest copy is what conversation.item.retrieve answers.
_ITEM_EVENTS = frozenset({"conversation.item.added", "conversation.item.done", "conversation.item.created",
                          "response.output_item.added", "response.output_item.done"})
# semantic_vad eagerness -> (factor on the server's silence timeouts, Smart Turn threshold).
# OpenAI: "low" waits longer for the caller to go on, "high" answers sooner; "auto" = "medium"
# = the server's own settings.
_EAGERNESS = {"low": (2.0, 0.7), "medium": (1.0, None), "auto": (1.0, None), "high": (0.5, 0.3)}


class _Conversation(Protocol):
    budget_tokens: int

    def delete(self, item_id: str) -> bool: ...
    @property
    def token_count(self) -> int: ...


class SessionPort(Protocol):
    """The part of :class:`voicebot.session.session.Session` the translator drives."""

    settings: SessionSettings
    input_ms: float  # caller audio processed so far

    @property
    def conversation(self) -> _Conversation: ...

    def push_audio(self, audio: bytes, sample_rate: int) -> None: ...
    def commit_input(self) -> str: ...
    def clear_input(self) -> None: ...
    def add_text(self, role: str, text: str, item_id: str | None = None) -> str: ...
    def create_response(self, options: ResponseOptions | None = None) -> str: ...
    def set_tools(self, tools: list[ToolSpec] | None = None, choice: ToolChoice | None = None) -> None: ...
    def add_tool_result(self, call_id: str, output: str, item_id: str | None = None) -> str: ...
    def add_tool_call(self, call_id: str, name: str, arguments: dict[str, object],
                      item_id: str | None = None) -> str: ...
    def cancel_response(self) -> bool: ...
    def truncate(self, item_id: str, audio_end_ms: int) -> str | None: ...
    def set_played(self, ms: int) -> None: ...
    def update_settings(self, **changes: object) -> None: ...


class RealtimeTranslator:
    def __init__(self, session: SessionPort, *, session_id: str, model: str, beta: bool = False,
                 voices: Collection[str] | None = None, audio_gate: edge.AudioGate | None = None,
                 control_gate: edge.ControlGate | None = None,
                 transcription_only: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.session = session
        self.audio_gate = audio_gate  # wire limits on caller audio (None: unlimited, for tests)
        self.control_gate = control_gate  # on every other event (None: unlimited, for tests)
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
        self._held: list[dict[str, Any]] | None = None  # a barged reply's response.done
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()  # id -> item as last sent
        self._metadata: OrderedDict[str, dict[str, str]] = OrderedDict()  # response id -> metadata
        self._last_response: str | None = None
        self._requested: str | None = None  # asked for by response.create, not yet created
        self._own_ids = itertools.count(1)
        self.tools: list[ToolSpec] = []  # session.tools as the client set them (TOOLS)
        self.tool_choice = ToolChoice()
        # turn_detection as the client set it (type, eagerness, idle_timeout_ms): echoed back.
        self._td_type = "server_vad"
        self._eagerness: str | None = None
        self._base_vad = session.settings.vad  # the server's own VAD settings ("auto" eagerness)
        self.noise_reduction: dict[str, Any] | None = None  # accepted and echoed; no denoiser runs
        self.transcription_only = False
        # idle_timeout_ms: after a reply, this long without speech makes the server reply.
        self._clock = clock
        self.idle_timeout_ms: int | None = None
        self._speaking = False
        self._idle_at: float | None = None  # when the timeout fires (on self._clock)
        self._idle_from_ms = 0.0  # caller audio position when the timer started
        if transcription_only:
            self._make_transcription_only()

    # ----------------------------------------------------------------- helpers
    @property
    def fam(self) -> rt.Family:
        return self.wire.fam

    def _link(self, item_id: str) -> str | None:
        prev, self._last_item = self._last_item, item_id
        return prev

    def _out(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for e in events:
            out.append({"type": e["type"], "event_id": f"event_{next(self._event_ids)}", **e})
            self._observe(e)
            if e["type"] == "response.created":  # OpenAI reports its rate limits as a reply starts
                out.append({"type": "rate_limits.updated", "event_id": f"event_{next(self._event_ids)}",
                            "rate_limits": self._rate_limits()})
        return out

    def _observe(self, e: dict[str, Any]) -> None:
        """Bookkeeping on every event sent: items for retrieve, metadata echo, the idle timer."""
        kind = e["type"]
        if kind in _ITEM_EVENTS and isinstance(e.get("item"), dict):
            self._remember(e["item"])
        elif kind == "conversation.item.deleted":
            self._items.pop(e["item_id"], None)
        elif kind in ("response.created", "response.done"):
            response = e["response"]
            self._last_response = response["id"]
            if self._requested == response["id"]:
                self._requested = None  # created (then replies.current has it) or over
            meta = self._metadata.get(response["id"])
            if meta is not None:
                response["metadata"] = meta
            if kind == "response.created":
                self._idle_at = None  # the timer runs after a reply, not during one
            else:
                self._metadata.pop(response["id"], None)
                self._arm_idle()
        elif kind == "input_audio_buffer.speech_started":
            self._speaking, self._idle_at = True, None
        elif kind == "input_audio_buffer.speech_stopped":
            self._speaking = False

    def _remember(self, item: dict[str, Any]) -> None:
        item_id = item.get("id")
        if not isinstance(item_id, str):
            return
        self._items[item_id] = item
        self._items.move_to_end(item_id)
        while len(self._items) > _MAX_ITEMS:
            self._items.popitem(last=False)

    def _rate_limits(self) -> list[dict[str, Any]]:
        # No request quota here; the one limit a caller meets is the history budget: the
        # oldest turns are summarised away when a reply would overflow it.
        conv = self.session.conversation
        budget = conv.budget_tokens
        return [{"name": "tokens", "limit": budget, "remaining": max(0, budget - conv.token_count),
                 "reset_seconds": 0.0}]

    def view(self) -> rt.SessionView:
        s = self.session.settings
        td: dict[str, Any] | None = None
        if s.turn_detection and self._td_type == "semantic_vad":
            td = {"type": "semantic_vad", "eagerness": self._eagerness or "auto",
                  "create_response": s.create_response, "interrupt_response": s.interrupt_response}
        elif s.turn_detection:
            td = {"type": "server_vad", "threshold": s.vad.threshold,
                  "prefix_padding_ms": s.vad.prefix_padding_ms, "silence_duration_ms": s.vad.min_silence_ms,
                  "create_response": s.create_response, "interrupt_response": s.interrupt_response,
                  "idle_timeout_ms": self.idle_timeout_ms}
        w = self.wire
        return rt.SessionView(self.id, self.model, s.system_prompt, self.voice_name, s.speed, w.in_fmt,
                              w.out_fmt, td, self.transcription, w.text_only, s.max_tokens,
                              transcription_only=self.transcription_only, noise_reduction=self.noise_reduction,
                              tools=tuple(t.as_realtime() for t in self.tools), tool_choice=self.tool_choice.as_wire())

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
            if self.control_gate is not None and data.get("type") != "input_audio_buffer.append":
                self.control_gate.check()  # audio has its own gate
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
                # The history holds what the model reads; the memory also holds items it
                # never reads (an image, an empty turn): either counts as existing.
                known = self._items.pop(ev.item_id, None) is not None
                if not self.session.conversation.delete(ev.item_id) and not known:
                    raise rt.RealtimeRequestError(  # OpenAI's text and code, param null
                        f"Error deleting item: the item with id {edge.clip(ev.item_id)} does not exist.",
                        code="item_delete_invalid_item_id")
                return [{"type": "conversation.item.deleted", "item_id": ev.item_id}]
            case rt.ItemRetrieve():
                item = self._items.get(ev.item_id)
                if item is None:
                    raise rt.RealtimeRequestError(  # OpenAI's text and code (Pipecat matches the code)
                        f"Error retrieving item: the item with id {edge.clip(ev.item_id)} does not exist.",
                        code="item_retrieve_invalid_item_id")
                return [{"type": "conversation.item.retrieved", "item": item}]
            case rt.OutputAudioClear():
                return self._clear_output()
            case rt.ResponseCreate():
                if self.transcription_only:
                    raise rt.RealtimeRequestError("a transcription session does not reply; "
                                                  "open a realtime session for responses",
                                                  code="invalid_value", param="type")
                if self.replies.current is not None:
                    raise rt.RealtimeRequestError(
                        f"response {self.replies.current.id} is still in progress; cancel it or wait for response.done",
                        code="conversation_already_has_active_response")
                metadata = _metadata((ev.response or {}).get("metadata"))
                # Per-response instructions / tools / tool_choice / max_output_tokens (TOOLS).
                options = realtime_tools.response_options(ev.response)
                if options is not None and options.tools:
                    self.replies.lazy_message = True
                try:
                    rid = self.session.create_response(options) if options else self.session.create_response()
                except ToolError as exc:
                    raise rt.RealtimeRequestError(str(exc), code="invalid_value", param="response.tool_choice") from None
                self._requested = rid  # cancellable before its response.created is out
                if metadata is not None:  # echoed in response.created / response.done (LiveKit waits for it)
                    self._metadata[rid] = metadata
                    while len(self._metadata) > 8:
                        self._metadata.popitem(last=False)
                return []  # response.created follows from the session's ResponseStarted
            case rt.ResponseCancel():
                # Only a reply the client knows of (created, or asked for) is cancelled: the
                # session may be preparing the next turn's reply speculatively, and a cancel
                # that raced the end of the last one (LiveKit sends one on every
                # speech_started) must not kill that.
                active = self.replies.current.id if self.replies.current is not None else self._requested
                if (active is None or (ev.response_id is not None and ev.response_id != active)
                        or not self.session.cancel_response()):
                    # OpenAI's exact text: clients match it to ignore a cancel that raced the end.
                    raise rt.RealtimeRequestError("Cancellation failed: no active response found",
                                                  code="response_cancel_not_active")
                return []  # response.done (cancelled) follows from the session
        raise AssertionError(ev)  # pragma: no cover: the union is exhaustive

    def _clear_output(self) -> list[dict[str, Any]]:
        """output_audio_buffer.clear: the client cut the reply's audio; stop making more."""
        current = self.replies.current
        if current is not None:
            self.session.cancel_response()  # response.done (cancelled) follows
        rid = current.id if current is not None else self._last_response
        return [{"type": "output_audio_buffer.cleared", "response_id": rid}]

    def _make_transcription_only(self) -> None:
        self.transcription_only = True
        # Turns are detected and transcribed; nothing ever starts a reply.
        self.session.update_settings(create_response=False)

    def _update(self, cfg: rt.SessionIn) -> list[dict[str, Any]]:
        given = cfg.model_fields_set
        if not self.fam.beta and cfg.type is None and "audio" not in given and given & rt.BETA_SESSION_FIELDS:
            self.wire.fam = rt.BETA  # an older client: answer in the names it knows
        if cfg.type == "transcription" and not self.transcription_only:
            if self.replies.current is not None:
                self.session.cancel_response()
            self._make_transcription_only()
        elif cfg.type == "realtime" and self.transcription_only:
            self.transcription_only = False
            self.session.update_settings(create_response=self.session.settings.turn_detection)
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
        td_given, td = False, None
        if "turn_detection" in a_in.model_fields_set:
            td_given, td = True, a_in.turn_detection
            changes.update(self._turn_detection(td))
        elif "turn_detection" in given:
            td_given, td = True, cfg.turn_detection
            changes.update(self._turn_detection(td))
        if self.transcription_only:
            changes["create_response"] = False
        noise = self.noise_reduction
        if "noise_reduction" in a_in.model_fields_set:
            noise = a_in.noise_reduction
        elif "input_audio_noise_reduction" in given:
            noise = cfg.input_audio_noise_reduction
        transcription = self.transcription  # echoed only: our one ASR always transcribes
        if "transcription" in a_in.model_fields_set:
            transcription = a_in.transcription
        elif "input_audio_transcription" in given:
            transcription = cfg.input_audio_transcription
        tokens = cfg.max_output_tokens if cfg.max_output_tokens is not None else cfg.max_response_output_tokens
        if tokens is not None:
            changes["max_tokens"] = self.default_max_tokens if tokens == "inf" else tokens
        modalities = cfg.output_modalities or cfg.modalities
        if modalities is not None and "audio_output" in SessionSettings.model_fields:
            changes["audio_output"] = "audio" in modalities  # text only: no TTS runs at all
        tools, choice = realtime_tools.session_tools(cfg)  # (TOOLS) applied before the rest: it may refuse
        if (tools is not None and tools != self.tools) or (choice is not None and choice != self.tool_choice):
            try:
                self.session.set_tools(tools, choice)
            except ToolError as exc:
                raise rt.RealtimeRequestError(str(exc), code="invalid_value", param="session.tool_choice") from None
            self.tools = tools if tools is not None else self.tools
            self.tool_choice = choice or self.tool_choice
            self.replies.lazy_message = self.replies.lazy_message or bool(self.tools)
        try:
            self.session.update_settings(**changes)
        except (ValidationError, ValueError, TypeError) as exc:
            loc = exc.errors()[0]["loc"] if isinstance(exc, ValidationError) else ()
            param = "session." + _SETTING_PARAMS.get(str(loc[0]), str(loc[0])) if loc else None
            raise rt.RealtimeRequestError(f"invalid session.update: {exc}", param=param) from None
        self.wire.in_fmt, self.wire.out_fmt, self.transcription = in_fmt, out_fmt, transcription
        self.noise_reduction = noise
        if td_given:
            self._td_type = td.type if td is not None else "server_vad"
            self._eagerness = td.eagerness if td is not None and td.type == "semantic_vad" else None
            # OpenAI: idle timeouts are a server_vad feature.
            self.idle_timeout_ms = td.idle_timeout_ms if td is not None and td.type == "server_vad" else None
            if self.idle_timeout_ms is None:
                self._idle_at = None
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
        if td.type == "semantic_vad":
            vad.update(self._semantic(td.eagerness or "auto"))
        else:
            vad["turn_detector"] = "silence"  # server_vad: silence alone ends the turn, as OpenAI's
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

    def _semantic(self, eagerness: str) -> dict[str, object]:
        """semantic_vad: our end-of-turn model (Smart Turn, when the server loaded it; else
        the silence rule), its patience scaled by ``eagerness``."""
        base = self._base_vad
        factor, threshold = _EAGERNESS[eagerness]
        silence = max(100, min(10_000, int(base.min_silence_ms * factor)))
        max_silence = max(base.smart_turn_check_ms + 100, min(10_000, int(base.smart_turn_max_silence_ms * factor)))
        return {"turn_detector": "smart_turn", "min_silence_ms": silence,
                "speculative_silence_ms": min(base.speculative_silence_ms, silence // 2),
                "smart_turn_max_silence_ms": max_silence,
                "smart_turn_threshold": base.smart_turn_threshold if threshold is None else threshold}

    # ------------------------------------------------------------- idle timeout
    def _arm_idle(self) -> None:
        if self.idle_timeout_ms is not None and not self._speaking and self.session.settings.turn_detection:
            self._idle_at = self._clock() + self.idle_timeout_ms / 1000.0
            self._idle_from_ms = self.session.input_ms

    def idle_due_in(self) -> float | None:
        """Seconds until the idle timeout fires (None: not running). The transport polls this."""
        return None if self._idle_at is None else max(0.0, self._idle_at - self._clock())

    def idle_check(self) -> list[dict[str, Any]]:
        """Fire the idle timeout if it is due: the silence becomes an (empty) user turn and
        the assistant replies to it, as OpenAI's ``input_audio_buffer.timeout_triggered``."""
        if self._idle_at is None or self._clock() < self._idle_at:
            return []
        self._idle_at = None
        if self._speaking or self.replies.current is not None or self.transcription_only:
            return []
        item_id = f"item_{self.id[5:]}_idle{next(self._own_ids)}"
        now_ms = int(self.session.input_ms)
        out = [{"type": "input_audio_buffer.timeout_triggered", "audio_start_ms": int(self._idle_from_ms),
                "audio_end_ms": now_ms, "item_id": item_id},
               *self._user_turn_committed(item_id)]
        if self.fam.item_done:
            out.append({"type": self.fam.item_done, "previous_item_id": None,
                        "item": rt.user_audio_item(item_id, "")})
        self._requested = self.session.create_response()
        return self._out(out)

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
        if item.type != "message":
            return self._create_tool_item(item)
        assert item.role is not None  # ItemIn requires one for a message
        if any(p.audio for p in item.content):
            raise rt.RealtimeRequestError("audio content in conversation.item.create is not supported; "
                                          "use input_audio_buffer.append", code="invalid_value", param="item.content")
        text = " ".join(t for p in item.content if (t := p.text if p.text is not None else p.transcript))
        if not text.strip():
            if not any(p.type == "input_image" for p in item.content):
                raise rt.RealtimeRequestError("the item has no text", code="invalid_value", param="item.content")
            # An image alone (LiveKit sends video frames so): the model reads text only, so it
            # is kept on the wire (retrieve, delete) but not in what the model reads.
            item_id = item.id or f"item_{self.id[5:]}_img{next(self._own_ids)}"
            prev = self._link(item_id)
            body = rt.item(item_id, item.role, [p.model_dump(exclude_none=True) for p in item.content])
            return [{"type": self.fam.item_added, "previous_item_id": prev, "item": body},
                    *([{"type": self.fam.item_done, "previous_item_id": prev, "item": body}]
                      if self.fam.item_done else [])]
        item_id = self.session.add_text(item.role, text, item.id)
        prev = self._link(item_id)
        body = rt.text_item(self.fam, item_id, item.role, text)
        out = [{"type": self.fam.item_added, "previous_item_id": prev, "item": body}]
        if self.fam.item_done:
            out.append({"type": self.fam.item_done, "previous_item_id": prev, "item": body})
        return out

    def _create_tool_item(self, item: rt.ItemIn) -> list[dict[str, Any]]:
        """A client's ``function_call_output`` (its result of a call) or ``function_call`` (TOOLS)."""
        if not item.call_id:
            raise rt.RealtimeRequestError(f"a {item.type} item needs a call_id", code="invalid_value",
                                          param="item.call_id")
        if item.type == "function_call_output":
            output = item.output or ""
            item_id = self.session.add_tool_result(item.call_id, output, item.id)
            body = realtime_tools.function_call_output_item(item_id, item.call_id, output)
        else:
            if not item.name:
                raise rt.RealtimeRequestError("a function_call item needs a name", code="invalid_value",
                                              param="item.name")
            arguments = realtime_tools.call_arguments(item)
            item_id = self.session.add_tool_call(item.call_id, item.name, arguments, item.id)
            body = realtime_tools.function_call_item(item_id, item.call_id, item.name, item.arguments or "{}",
                                                     "completed")
        prev = self._link(item_id)
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
        heard = self.session.truncate(item_id, audio_end_ms)
        if heard is None:
            raise rt.RealtimeRequestError(f"no assistant audio item {edge.clip(item_id)} to truncate",
                                          code="unknown_item", param="item_id")
        if item_id in self._items:  # a retrieve now shows what the caller heard
            self._items[item_id] = rt.reply_item(self.fam, item_id, heard, "incomplete", self.wire.text_only)
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
            case se.ToolCallStarted():
                return self.replies.call_started(event)
            case se.ToolCallArgumentsDelta():
                return self.replies.call_arguments(event)
            case se.ToolCallDone():
                return self.replies.call_done(event)
            case se.ResponseAudio():
                return self.replies.audio(event)
            case se.ResponseDone():
                out = self.replies.finish(event)
                if event.status == "interrupted":
                    # Speech stopped it (a barge-in, or speech before its audio began):
                    # sent after the speech_started that caused it.
                    self._held, out = out, []
                return out
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
        else:  # beta sends no item.done: a retrieve still shows the transcript
            self._remember(rt.user_audio_item(item_id, text))
        return out


def _metadata(value: object) -> dict[str, str] | None:
    """``response.metadata``: string pairs within OpenAI's limits, or a clear error."""
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > _MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in value.items())):
        raise rt.RealtimeRequestError("response.metadata must be at most 16 string pairs "
                                      "(keys up to 64, values up to 512 characters)",
                                      code="invalid_value", param="response.metadata")
    return dict(value)
