"""One WebRTC call: a peer connection bound to one session, from offer to hang-up.

    mic track --Opus--> decode (aiortc) -> mono float32 -> session.push_audio(48 kHz)
    session events -> ResponseAudio -> ReplyTrack (48 kHz, track clock) --Opus--> page
                   -> everything else -> Realtime server events on "oai-events"
    "oai-events" messages -> Realtime client events -> session calls

The call is one task (started by the HTTP handler, owned by ``webrtc.Calls``) that
holds the session open and runs its workers in one TaskGroup. It ends, and closes the
peer connection, on whichever comes first: the data channel closing, the connection
failing or closing, the mic track ending, the session closing (fatal error, idle,
shutdown), no connection within ``_CONNECT_TIMEOUT_S`` of the answer, or ``end()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections import deque
from typing import Any

import av
from aiortc import RTCConfiguration, RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.exceptions import InvalidStateError
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from voicebot.errors import BadMessage, VoicebotError
from voicebot.server import edge
from voicebot.server.connection import Connection
from voicebot.session import events as ev
from voicebot.session.session import Session
from voicebot.transports import realtime_events as rt
from voicebot.transports.realtime_session import RealtimeTranslator
from voicebot.transports.webrtc_tracks import RATE, ReplyTrack
from voicebot.wire.av_frames import frame_to_mono

log = logging.getLogger(__name__)

CHANNEL = "oai-events"
_CONNECT_TIMEOUT_S = 20.0  # answered but never connected: the page went away
_CLOSE_TIMEOUT_S = 5.0
_COMMAND_QUEUE = 256  # client events waiting to be applied; a flood beyond is refused
_EARLY_EVENTS = 64  # server events held until the data channel opens
# Audio travels on the media track: these never go on the data channel. The translator
# still sees every ResponseAudio (and encodes a delta we drop, a small cost per second of
# reply) because its count of audio sent is what conversation.item.truncate is checked
# against; it has no audio-on-a-media-track mode yet.
_AUDIO_EVENTS = frozenset({rt.GA.audio_delta, rt.BETA.audio_delta})


def call_id(worker: int) -> str:
    """A new call's id, "rtc_<worker>_<hex>": the worker that holds the call is in it, so a
    hang-up another worker of the port receives is forwarded to it (voicebot/server/forward.py)."""
    return f"rtc_{worker}_{uuid.uuid4().hex[:20]}"


def worker_of(call_id: str) -> int | None:
    """The worker a call id names (None: not one of :func:`call_id`'s)."""
    parts = call_id.split("_")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "rtc" and parts[1].isdigit() else None


class Call:
    def __init__(
        self,
        conn: Connection,
        offer_sdp: str,
        session_config: dict[str, Any],
        *,
        beta: bool = False,
    ) -> None:
        self.conn = conn  # the request that offered the call: the call's way through the edge
        self.state = conn.state
        self.max_bytes = conn.max_bytes
        self.gate = conn.audio_gate()
        self.beta = beta  # the beta flow (POST /v1/realtime) gets the beta event names
        self.id = call_id(self.state.siblings.index)
        self.offer_sdp = offer_sdp
        self.session_config = session_config
        self.answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # The HTTP handler may be gone (client hung up mid-offer): mark errors as seen.
        self.answer.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.end_reason: str | None = None
        self.session: Session | None = None
        self.pc: RTCPeerConnection | None = None
        self.track = ReplyTrack(listener=self)
        self._ended = asyncio.Event()
        self._connected = asyncio.Event()
        self._mic: MediaStreamTrack | None = None
        self._mic_ready = asyncio.Event()
        self._channel: RTCDataChannel | None = None
        self._early: deque[dict[str, Any]] = deque(maxlen=_EARLY_EVENTS)
        self._commands: asyncio.Queue[str] = asyncio.Queue(maxsize=_COMMAND_QUEUE)
        self._tr: RealtimeTranslator | None = None
        self._current: str | None = None  # the reply whose audio is being sent

    # ------------------------------------------------------------------ lifecycle
    def end(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason
        self._ended.set()

    async def run(self) -> None:
        try:
            settings = self.state.default_settings()
            settings.output_sample_rate = RATE  # the session resamples replies once, to Opus' rate
            async with self.conn.session(settings) as session:
                self.session = session
                self._tr = RealtimeTranslator(
                    session,
                    session_id=session.id,
                    model=str(self.session_config.get("model") or self.state.cfg.llm.model),
                    beta=self.beta,
                    voices=self.state.voices(),
                    control_gate=self.conn.control_gate(),
                )
                await self._negotiate()
                self._configure()
                await self._serve(session)
                if self.end_reason is not None:
                    self.conn.end(self.end_reason)
        except VoicebotError as exc:
            if not self.answer.done():
                self.answer.set_exception(exc)
            else:
                log.warning("[%s] call failed: %s", self.id, exc)
        except Exception as exc:
            log.exception("[%s] call failed", self.id)
            if not self.answer.done():
                self.answer.set_exception(VoicebotError(f"{type(exc).__name__}: {exc}"))
        finally:
            if not self.answer.done():
                self.answer.set_exception(
                    VoicebotError(f"call ended before answering ({self.end_reason})")
                )
            await self._close_pc()
            log.info("[%s] call ended (%s)", self.id, self.end_reason)

    async def _negotiate(self) -> None:
        # No STUN/TURN: host candidates only; the server must be reachable directly.
        pc = self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.state.peer_connections.add(pc)
        pc.on("connectionstatechange", self._on_state)
        pc.on("track", self._on_track)
        pc.on("datachannel", self._on_datachannel)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=self.offer_sdp, type="offer"))
        except (ValueError, KeyError, IndexError) as exc:
            raise BadMessage(f"unusable SDP offer: {exc}", code="invalid_sdp") from None
        if not any(t.kind == "audio" for t in pc.getTransceivers()):
            raise BadMessage("the offer has no audio section", code="invalid_sdp")
        pc.addTrack(self.track)
        await pc.setLocalDescription(await pc.createAnswer())
        if not self.answer.done():
            self.answer.set_result(pc.localDescription.sdp)

    def _configure(self) -> None:
        """Session config from the secret or the multipart offer, before session.created,
        so that event already shows it (as OpenAI's does)."""
        assert self._tr is not None
        config = {k: v for k, v in self.session_config.items() if k != "model"}
        if config:
            replies = self._tr.client_message(
                json.dumps({"type": "session.update", "session": config})
            )
            for event in replies:
                if event["type"] == "error":
                    self._send(event)

    async def _serve(self, session: Session) -> None:
        async with asyncio.TaskGroup() as tg:
            workers = [
                tg.create_task(self._inbound(session)),
                tg.create_task(self._outbound(session)),
                tg.create_task(self._apply_commands()),
                tg.create_task(self._watchdog()),
            ]
            await self._ended.wait()
            for task in workers:
                task.cancel()

    async def _close_pc(self) -> None:
        pc, self.pc = self.pc, None
        self.track.stop()
        if pc is None:
            return
        try:
            await asyncio.wait_for(pc.close(), _CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("[%s] peer connection did not close in %.0f s", self.id, _CLOSE_TIMEOUT_S)
        finally:
            self.state.peer_connections.discard(pc)

    # ------------------------------------------------------------- aiortc events
    def _on_state(self) -> None:
        state = self.pc.connectionState if self.pc is not None else "closed"
        log.debug("[%s] connection %s", self.id, state)
        if state == "connected":
            self._connected.set()
        elif state in ("failed", "closed"):
            self.end(f"connection {state}")

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio" and self._mic is None:
            self._mic = track
            self._mic_ready.set()

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != CHANNEL or self._channel is not None:
            return  # other channels are the page's business
        self._channel = channel
        channel.on("message", self._on_message)
        channel.on("close", lambda: self.end("data channel closed"))
        if channel.readyState == "open":
            self._flush_early()
        else:
            channel.on("open", self._flush_early)

    def _on_message(self, message: str | bytes) -> None:
        if not isinstance(message, str):
            self._send_error("invalid_event", "events are JSON text; audio goes on the media track")
            return
        if len(message) > self.max_bytes:  # the same limit as a WebSocket message
            self._send_error("message_too_large",
                             f"message of {len(message)} bytes exceeds server.max_message_bytes ({self.max_bytes})")
            return
        try:
            self._commands.put_nowait(message)
        except asyncio.QueueFull:
            self._send_error("rate_limited", "too many events in flight; this one was dropped")

    # -------------------------------------------------------------------- workers
    async def _watchdog(self) -> None:
        try:
            await asyncio.wait_for(self._connected.wait(), _CONNECT_TIMEOUT_S)
        except TimeoutError:
            self.end("no connection")

    async def _inbound(self, session: Session) -> None:
        await self._mic_ready.wait()
        assert self._mic is not None
        while True:
            try:
                frame = await self._mic.recv()
            except MediaStreamError:
                self.end("mic track ended")
                return
            if isinstance(frame, av.AudioFrame):  # an audio track yields nothing else
                try:
                    self.gate.check(frame.samples, frame.sample_rate)
                except VoicebotError as exc:  # a peer sending faster than real time
                    if self.gate.report_due():
                        self._send_error(exc.code, str(exc))
                    continue
                session.push_audio(frame_to_mono(frame), frame.sample_rate)

    async def _outbound(self, session: Session) -> None:
        tr = self._tr
        assert tr is not None
        self._send_all(tr.opening())
        async for event in session.events():
            if isinstance(event, ev.ResponseAudio):
                self._current = event.response_id
                self.track.push(event.response_id, event.audio, event.sample_rate)
            elif isinstance(event, ev.BargeIn):
                self.track.flush()
                self._send(
                    {"type": "output_audio_buffer.cleared", "response_id": event.response_id}
                )
            elif isinstance(event, ev.TurnTimings):
                # Server-side stage latencies (not an OpenAI event; clients ignore unknown
                # types): lets the probe put the WebRTC path's own cost next to them.
                self._send({"type": "voicebot.turn.timings", **dataclasses.asdict(event)})
            elif isinstance(event, ev.ResponseDone):
                self.track.finish(event.response_id)
                # Until the next reply's audio reaches the wire, none of it was heard.
                session.set_played(0)
                self._current = None
            self._send_all(tr.session_event(event))
        self.end(f"session closed ({session.closed_reason})")

    async def _apply_commands(self) -> None:
        tr = self._tr
        assert tr is not None
        while True:
            text = await self._commands.get()
            kind = _peek_type(text)
            if kind == "output_audio_buffer.clear":
                # The page cuts the reply audio it has not played yet. The translator then
                # cancels the reply, as on the WebSocket (response.done "cancelled",
                # output_audio_buffer.cleared): flushing the track alone left the reply
                # generating and its whole text in the history as if heard.
                self.track.flush()
                self._send_all(tr.client_message(text))
            elif kind == "input_audio_buffer.append":
                self._send_error("invalid_event", "over WebRTC, audio goes on the media track")
            else:
                self._send_all(tr.client_message(text))

    # ------------------------------------------------------- ReplyTrack listener
    def audio_started(self, response_id: str) -> None:
        self._send({"type": "output_audio_buffer.started", "response_id": response_id})

    def audio_sent(self, response_id: str, ms: int) -> None:
        if self.session is not None and response_id == self._current:
            self.session.set_played(ms)  # what went on the wire, for barge-in truncation

    def audio_stopped(self, response_id: str) -> None:
        self._send({"type": "output_audio_buffer.stopped", "response_id": response_id})

    # ----------------------------------------------------------------- data out
    def _send_all(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            if event["type"] in _AUDIO_EVENTS:
                continue
            if event["type"] == "error":
                self.conn.count_error(str(event["error"].get("code")))
            self._send(event)

    def _send(self, event: dict[str, Any]) -> None:
        event.setdefault("event_id", f"event_{uuid.uuid4().hex[:20]}")
        channel = self._channel
        if channel is None or channel.readyState == "connecting":
            self._early.append(event)  # bounded: only the first moments of a call
            return
        if channel.readyState != "open":
            return
        with contextlib.suppress(InvalidStateError):  # closing under us: the call ends anyway
            channel.send(json.dumps(event))

    def _send_error(self, code: str, message: str) -> None:
        self._send(rt.error(code, message))

    def _flush_early(self) -> None:
        while self._early and self._channel is not None and self._channel.readyState == "open":
            self._send(self._early.popleft())


def _peek_type(text: str) -> str | None:
    """The type of a client event, for the few that are WebRTC's own business."""
    try:
        data = edge.load_json(text)  # bounded: this runs on every data-channel message
    except BadMessage:
        return None  # the translator reports it
    kind = data.get("type") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None
