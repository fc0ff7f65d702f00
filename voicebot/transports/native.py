"""The native WebSocket protocol at ``/ws`` (documented in docs/protocol.md).

Binary frames carry PCM16 mono little-endian audio both ways; text frames carry JSON
events. The first text message configures the session::

    {"type": "session.start", "sample_rate": 16000, "output_sample_rate": 24000,
     "system_prompt": "...", "voice": null, "vad": {"min_silence_ms": 400}}

Translation only: parsing is :func:`parse_command`, rendering is :func:`render_event`,
both synchronous; the session core does the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from voicebot.audio import ReplyResampler, float_to_pcm16
from voicebot.config import VadConfig
from voicebot.errors import BadAudio, BadMessage, VoicebotError
from voicebot.server import edge
from voicebot.server.connection import Connection
from voicebot.server.state import ServerState
from voicebot.session import events as ev
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings
from voicebot.transports.tasks import close_quietly, refused_origin, run_until_first_ends

log = logging.getLogger(__name__)

_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)


class StartMessage(BaseModel):
    """The first message of a native session."""

    model_config = ConfigDict(extra="forbid")
    type: str = Field("session.start", pattern=r"^session\.start$")
    sample_rate: int = Field(16000, description="Rate of the audio the client sends.")
    output_sample_rate: int | None = Field(None, description="Rate of the audio the client wants back.")
    system_prompt: str | None = Field(None, max_length=20_000)
    voice: str | None = None
    speed: float | None = Field(None, ge=0.25, le=4.0)
    language: str | None = None
    vad: dict[str, Any] | None = None
    turn_detection: bool | None = None
    max_tokens: int | None = Field(None, ge=1, le=4096)


# What a native session.update may change (docs/protocol.md): session.start's settings
# but the rates, plus whether turns get replies and whether speech interrupts them.
UPDATABLE = ("system_prompt", "voice", "speed", "language", "vad", "turn_detection", "max_tokens",
             "create_response", "interrupt_response")


def _rate(value: int, what: str) -> int:
    if value not in _RATES:
        raise BadMessage(f"{what} {value} not supported; use one of {_RATES}", code="unsupported_format")
    return value


def settings_from_start(base: SessionSettings, msg: StartMessage) -> SessionSettings:
    data = base.model_dump()
    for key in ("system_prompt", "voice", "speed", "language", "turn_detection", "max_tokens"):
        value = getattr(msg, key)
        if value is not None:
            data[key] = value
    if msg.vad:
        data["vad"] = {**data["vad"], **msg.vad}
    try:
        return SessionSettings.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise BadMessage(f"invalid session settings: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def parse_json(text: str) -> dict[str, Any]:
    return edge.load_event(text)  # bounded in depth: never a RecursionError


def apply_command(session: Session, data: dict[str, Any]) -> dict[str, Any] | None:
    """Carry out one client event; may return an acknowledgement event."""
    kind = data["type"]
    if kind == "input.commit":
        return {"type": "input.committed", "item_id": session.commit_input()}
    if kind == "input.clear":
        session.clear_input()
        return {"type": "input.cleared"}
    if kind == "response.create":
        return {"type": "response.created", "response_id": session.create_response()}
    if kind == "response.cancel":
        session.cancel_response()
        return None
    if kind == "text.input":
        text = data.get("text")
        if not isinstance(text, str) or not text.strip():
            raise BadMessage("text.input needs a non-empty 'text'")
        item = session.add_text("user", text)
        if data.get("respond", True):
            session.create_response()
        return {"type": "text.added", "item_id": item}
    if kind == "session.update":
        fields = {k: v for k, v in data.items() if k not in ("type", "event_id")}
        # Checked here: update_settings copies the settings with these fields, and a
        # copy drops names it does not know, so a typo ("max_token") or a rate, fixed at
        # session.start, was acknowledged and changed nothing.
        if unknown := sorted(set(fields) - set(UPDATABLE)):
            fixed = [k for k in unknown if k in ("sample_rate", "output_sample_rate")]
            why = "is fixed at session.start" if fixed == unknown else "is not a session setting"
            raise BadMessage(f"invalid session.update: {edge.clip(', '.join(unknown))} {why}; "
                             f"it can change {', '.join(UPDATABLE)}")
        if "vad" in fields and not isinstance(fields["vad"], dict):  # model_copy(update=5) raised AttributeError
            raise BadMessage("invalid session.update: 'vad' must be an object of VAD settings")
        try:
            if "vad" in fields:  # merged, and checked like the rest (a misspelt VAD key too)
                fields["vad"] = VadConfig.model_validate({**session.settings.vad.model_dump(), **fields["vad"]})
            session.update_settings(**fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise BadMessage(f"invalid session.update: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        except (ValueError, TypeError) as exc:
            raise BadMessage(f"invalid session.update: {exc}") from None
        return {"type": "session.updated"}
    if kind == "session.end":
        raise _Hangup
    raise BadMessage(f"unknown event type {edge.clip(kind)}", code="unknown_event")


class _Hangup(Exception):
    pass


def render_event(event: ev.SessionEvent) -> dict[str, Any] | None:
    """Session event -> JSON event (audio is sent separately as binary)."""
    match event:
        case ev.SpeechStarted():
            return {"type": "speech.started", **asdict(event)}
        case ev.SpeechStopped():
            return {"type": "speech.stopped", **asdict(event)}
        case ev.TranscriptPartial():
            return {"type": "transcript.partial", "text": event.text, **asdict(event)}
        case ev.TranscriptFinal():
            return {"type": "transcript.final", **asdict(event)}
        case ev.ResponseStarted():
            return {"type": "response.started", **asdict(event)}
        case ev.ResponseTextDelta():
            return {"type": "response.text.delta", **asdict(event)}
        case ev.ResponseAudioStarted():
            return {"type": "response.audio.started", **asdict(event)}
        case ev.ResponseDone():
            return {"type": "response.done", **asdict(event)}
        case ev.ToolCallDone(call=call):  # server-side tools (docs/tools.md): what the model called
            return {"type": "tool.call", "response_id": event.response_id, **asdict(call)}
        case ev.ToolResult():
            return {"type": "tool.result", **asdict(event)}
        case ev.BargeIn():
            return {"type": "barge_in", **asdict(event)}
        case ev.TurnTimings():
            return {"type": "turn.timings", **asdict(event)}
        case ev.Dtmf():
            return {"type": "dtmf", **asdict(event)}
        case ev.ErrorEvent():
            return {"type": "error", **asdict(event)}
    return None


def routes(state: ServerState) -> list[BaseRoute]:
    return [WebSocketRoute("/ws", endpoint(state))]


def endpoint(state: ServerState):  # type: ignore[no-untyped-def]
    async def handle(ws: WebSocket) -> None:
        conn = Connection(state, "native", ws)
        if await refused_origin(ws, conn):
            return
        await ws.accept()
        try:
            conn.authenticate(conn.query.get("token"))
            start = await _read_start(ws, conn)
            settings = settings_from_start(state.default_settings(), start)
            out_rate = start.output_sample_rate or state.cfg.session.output_sample_rate
            settings.output_sample_rate = out_rate
            async with conn.session(settings) as session:
                await ws.send_json(
                    {
                        "type": "session.started",
                        "session_id": session.id,
                        "sample_rate": start.sample_rate,
                        "output_sample_rate": out_rate,
                    }
                )
                await _run(ws, conn, session, start.sample_rate, out_rate)
        except WebSocketDisconnect:
            return
        except VoicebotError as exc:
            await _send_error_and_close(ws, exc, conn.refuse(exc))

    return handle


async def _read_start(ws: WebSocket, conn: Connection) -> StartMessage:
    try:
        text = await asyncio.wait_for(ws.receive_text(), timeout=10.0)
    except TimeoutError:
        raise BadMessage("no session.start within 10 s") from None
    except KeyError:
        raise BadMessage("the first message must be a JSON session.start") from None
    conn.check_size(len(text))
    try:
        msg = StartMessage.model_validate(parse_json(text))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise BadMessage(f"session.start: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    _rate(msg.sample_rate, "sample_rate")
    if msg.output_sample_rate is not None:
        _rate(msg.output_sample_rate, "output_sample_rate")
    return msg


async def _send_error_and_close(ws: WebSocket, exc: VoicebotError, code: int) -> None:
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await ws.send_json({"type": "error", "code": exc.code, "message": str(exc), "fatal": True})
    await close_quietly(ws, code)


async def _run(ws: WebSocket, conn: Connection, session: Session, in_rate: int, out_rate: int) -> None:
    gate = conn.audio_gate()
    control = conn.control_gate()

    async def reader() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            event_id = None
            try:
                if msg.get("bytes") is not None:
                    data = msg["bytes"]
                    conn.check_size(len(data), "audio frame")
                    if len(data) % 2:
                        raise BadAudio("PCM16 frames need an even number of bytes")
                    gate.check(len(data) // 2, in_rate)  # length and rate: refused, not queued
                    session.push_audio(data, in_rate)
                elif msg.get("text") is not None:
                    control.check()  # before parsing: a flood is refused at the cost of a counter
                    conn.check_size(len(msg["text"]))
                    data = parse_json(msg["text"])
                    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
                    reply = apply_command(session, data)
                    if reply is not None:
                        await ws.send_json(reply)
            except _Hangup:
                return
            except VoicebotError as exc:
                # Bad input costs the client an error event, nothing more.
                session.error(exc.code, str(exc), event_id=event_id, fatal=exc.fatal)

    async def writer() -> None:
        reply_audio = ReplyResampler(out_rate)  # the call speaks at out_rate: a pass-through
        async for event in session.events():
            if isinstance(event, ev.ResponseAudio):
                audio = reply_audio.process(event.response_id, event.audio, event.sample_rate)
                await ws.send_bytes(float_to_pcm16(audio))
                continue
            body = render_event(event)
            if body is not None:
                await ws.send_json(body)
            if isinstance(event, ev.ErrorEvent) and event.fatal:
                return

    await run_until_first_ends(conn, {"ws-in": reader(), "ws-out": writer()}, reason="client closed")
    await close_quietly(ws, conn.close_code)
