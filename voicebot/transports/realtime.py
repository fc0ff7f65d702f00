"""OpenAI Realtime API compatibility at ``/v1/realtime`` (WebSocket); see docs/realtime.md.

Point an OpenAI Realtime client at ``ws://HOST:PORT/v1`` (the SDK's
``websocket_base_url``) and it talks to the voicebot session core. All translation is in
:class:`~voicebot.transports.realtime_session.RealtimeTranslator` (synchronous); this
module only moves frames: a reader (client -> translator -> session) and a writer
(session events -> translator -> client).

Naming family: GA names unless the client asks for the beta, with the
``OpenAI-Beta: realtime=v1`` header, the ``openai-beta.realtime-v1`` subprotocol, or by
sending flat beta session fields (``input_audio_format``...) in a ``session.update``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from typing import Any

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from voicebot.errors import AuthError, BadMessage, MessageTooLarge, ProtocolError, VoicebotError
from voicebot.server.connection import Connection
from voicebot.server.state import ServerState
from voicebot.session import events as se
from voicebot.session.session import Session
from voicebot.transports import realtime_events as rt
from voicebot.transports.realtime_session import RealtimeTranslator
from voicebot.transports.tasks import close_quietly, refused_origin, run_until_first_ends

log = logging.getLogger(__name__)

_KEY_PROTOCOL = "openai-insecure-api-key."
_BETA_PROTOCOL = "openai-beta.realtime-v1"
# An oversized message is not parsed; its event_id is looked for in its two ends only.
_EVENT_ID = re.compile(r'"event_id"\s*:\s*"([^"\\]{1,512})"')
_IDLE_POLL_S = 0.2  # idle_timeout_ms resolution


def routes(state: ServerState) -> list[BaseRoute]:
    return [WebSocketRoute("/v1/realtime", endpoint(state))]


def _auth(ws: WebSocket) -> tuple[str | None, str | None, bool]:
    """(chosen subprotocol, API key from a subprotocol, beta requested)."""
    offered: list[str] = list(ws.scope.get("subprotocols") or [])
    key = next((p[len(_KEY_PROTOCOL):] for p in offered if p.startswith(_KEY_PROTOCOL)), None)
    # Browsers fail the handshake unless the server picks one of theirs; never echo the key.
    chosen = "realtime" if "realtime" in offered else None
    beta = _BETA_PROTOCOL in offered or ws.headers.get("openai-beta", "").strip().lower() == "realtime=v1"
    return chosen, key, beta


def endpoint(state: ServerState):  # type: ignore[no-untyped-def]
    async def handle(ws: WebSocket) -> None:
        conn = Connection(state, "realtime", ws)
        if await refused_origin(ws, conn):
            return
        subprotocol, key, beta = _auth(ws)
        await ws.accept(subprotocol=subprotocol)
        try:
            conn.authenticate(key)
            async with conn.session() as session:
                model = conn.query.get("model") or state.cfg.llm.model
                # GA transcription sessions connect with ?intent=transcription.
                transcription = conn.query.get("intent") == "transcription"
                translator = RealtimeTranslator(session, session_id=session.id, model=model, beta=beta,
                                                voices=state.voices(), audio_gate=conn.audio_gate(),
                                                control_gate=conn.control_gate(),
                                                transcription_only=transcription)
                await _run(ws, conn, session, translator)
        except WebSocketDisconnect:
            return
        except VoicebotError as exc:  # refused before the session began: fatal
            await _refuse(ws, exc, conn.refuse(exc))

    return handle


async def _refuse(ws: WebSocket, exc: VoicebotError, code: int) -> None:
    kind = "invalid_request_error" if isinstance(exc, AuthError | ProtocolError) else "server_error"
    body = {"type": "error", "event_id": "event_0", **rt.error(exc.code, str(exc), kind=kind)}
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await ws.send_text(json.dumps(body))
    await close_quietly(ws, code)


async def _run(ws: WebSocket, conn: Connection, session: Session, tr: RealtimeTranslator) -> None:
    max_bytes = conn.max_bytes
    # One lock around "translate, then send": the translator's state is shared by both
    # directions, and a reply (input_audio_buffer.committed) must reach the client before
    # the events it causes (the transcription of that item).
    lock = asyncio.Lock()

    async def send(events: list[dict[str, Any]]) -> None:
        for body in events:
            await ws.send_text(json.dumps(body, separators=(",", ":")))

    async def reader() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            text: str | None = msg.get("text")
            async with lock:
                if text is None:
                    out = tr.error(BadMessage("binary frames are not part of this protocol; "
                                              "send audio with input_audio_buffer.append"))
                elif len(text) > max_bytes:
                    found = _EVENT_ID.search(text[:1024]) or _EVENT_ID.search(text[-1024:])
                    out = tr.error(MessageTooLarge(f"message of {len(text)} bytes exceeds {max_bytes}"),
                                   found.group(1) if found else None)
                else:
                    out = tr.client_message(text)
                for body in out:  # the session counts its own errors; these are the client's
                    if body["type"] == "error":
                        conn.count_error(body["error"]["code"])
                await send(out)

    async def writer() -> None:
        async for event in session.events():
            async with lock:
                await send(tr.session_event(event))
            if isinstance(event, se.ErrorEvent) and event.fatal:
                return

    async def idle() -> None:
        # turn_detection.idle_timeout_ms: the translator keeps the deadline; this task
        # only wakes it. A short poll, since a reply or speech moves the deadline.
        while True:
            due = tr.idle_due_in()
            await asyncio.sleep(_IDLE_POLL_S if due is None else min(due, _IDLE_POLL_S))
            if due is not None:
                async with lock:
                    await send(tr.idle_check())

    await send(tr.opening())
    await run_until_first_ends(conn, {"rt-reader": reader(), "rt-writer": writer(), "rt-idle": idle()},
                               reason="client closed")
    await close_quietly(ws, conn.close_code)
