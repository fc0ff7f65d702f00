"""Phone calls: Twilio Media Streams (and Telnyx) at ``/twilio``; TwiML at ``/twilio/voice``.

    caller <-> Twilio <-> ws /twilio: JSON {event: connected|start|media|dtmf|mark|stop}
                                      back: {event: media|mark|clear}

Inbound μ-law 8 kHz goes to the session as float32 at 8 kHz (the session resamples it
to 16 kHz with a stateful soxr stream). The call speaks at 8 kHz (it resamples each
sentence once); reply audio is cut into exact 160-byte frames and sent one per 20 ms
by the pacer, with a mark every ``telephony.mark_interval_ms``; the echoed
marks keep ``session.set_played`` current, so a barge-in cuts the history at what
the caller really heard. Parsing and bookkeeping live in :mod:`.twilio_protocol`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import time
from collections import deque

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from voicebot.audio import ReplyResampler
from voicebot.errors import AuthError, BadMessage, VoicebotError
from voicebot.server import edge
from voicebot.server.connection import Connection
from voicebot.server.state import ServerState
from voicebot.session import events as ev
from voicebot.session.session import Session
from voicebot.transports import twilio_protocol as tp
from voicebot.transports.pacing import Pacer
from voicebot.transports.tasks import close_quietly, run_until_first_ends
from voicebot.wire import twilio_media as tm

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 10.0
_LOGGED_BAD = 5  # a broken stream would log every 20 ms; the rest go to DEBUG
_PACER_LEAD_S = 0.04
_MAX_QUEUED = 3000  # messages (~50 s of audio with its marks)
_MAX_WEBHOOK_BODY = 64 << 10  # Twilio's call webhook: ~30 short form fields


def routes(state: ServerState) -> list[BaseRoute]:
    return [
        WebSocketRoute("/twilio", _stream_endpoint(state)),
        Route("/twilio/voice", _voice_webhook(state), methods=["GET", "POST"]),
    ]


# ---------------------------------------------------------------- TwiML webhook
def _basic_password(authorization: str | None) -> str | None:
    """Twilio sends webhook credentials as HTTP basic auth (https://user:key@host/...)."""
    if not authorization or not authorization.lower().startswith("basic "):
        return None
    try:
        user, _, password = base64.b64decode(authorization[6:]).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return password or user


def _auth_token(state: ServerState) -> str | None:
    """The Twilio account's auth token (config, else its environment variable), per request."""
    tel = state.cfg.telephony
    return tel.auth_token or os.environ.get(tel.auth_token_env) or None


def _signed_url(state: ServerState, scope_scheme: str, headers: dict[str, str], host: str,
                path: str, query: str) -> str:
    return tp.request_url(state.cfg.telephony.public_url, headers, scope_scheme, host, path, query)


def _voice_webhook(state: ServerState):  # type: ignore[no-untyped-def]
    async def voice(request: Request) -> Response:
        conn = Connection(state, "twilio", request, per_client=False)
        auth = request.headers.get("authorization")
        headers = {k.lower(): v for k, v in request.headers.items()}
        host = request.headers.get("host") or f"{request.url.hostname}:{request.url.port}"
        token = _auth_token(state)
        form: list[tuple[str, str]] = []  # Twilio's call fields (POST; a GET has them in the query)
        try:
            if token is None:
                conn.authenticate(conn.query.get("token") or _basic_password(auth))
            if request.method == "POST":
                request = await edge.read_body(request, _MAX_WEBHOOK_BODY)
                async with request.form(max_files=0, max_fields=200) as data:
                    form = [(k, v) for k, v in data.multi_items() if isinstance(v, str)]
            if token is not None:
                # Twilio signs the URL it called plus the POSTed form fields.
                url = _signed_url(state, request.url.scheme, headers, host, request.url.path, request.url.query)
                if not tp.signature_valid(token, url, form, request.headers.get("x-twilio-signature")):
                    raise AuthError("missing or invalid X-Twilio-Signature")
        except AuthError as exc:
            conn.refuse(exc)
            log.warning("twilio webhook refused: %s", exc)
            if token:  # a bad signature: credentials would not help
                return Response(str(exc), 403)
            return Response(str(exc), 401, {"WWW-Authenticate": 'Basic realm="voicebot"'})
        except VoicebotError as exc:
            return Response(str(exc), conn.refuse_http(exc))
        try:
            conn.check_admission()  # calls come from Twilio's servers: not per client
        except VoicebotError as exc:
            conn.refuse(exc)
            log.warning("twilio call refused: %s: %s", exc.code, exc)
            return Response(tp.twiml_busy(state.cfg.telephony.busy_message), media_type="application/xml")
        params = {k: v for k, v in request.query_params.items() if k in tp.CALL_FIELDS}
        # The numbers reach the stream only through the TwiML: its start message has none.
        params.update(tp.number_params(form if request.method == "POST" else list(request.query_params.items())))
        if state.auth_required:
            # Twilio cannot send headers on the stream: a short-lived secret goes in the
            # TwiML instead of the long-lived key.
            try:
                params["token"], _ = state.mint_secret(ttl_s=120.0)
            except VoicebotError as exc:
                conn.refuse(exc)
                return Response(str(exc), 503)
        url = tp.stream_url(state.cfg.telephony.public_url, headers, request.url.scheme, host)
        return Response(tp.twiml_connect(url, params), media_type="application/xml")

    return voice


# --------------------------------------------------------------- media stream
def _stream_endpoint(state: ServerState):  # type: ignore[no-untyped-def]
    async def handle(ws: WebSocket) -> None:
        # Calls come from the carrier's media servers: no per-client limit.
        conn = Connection(state, "twilio", ws, per_client=False)
        await ws.accept()
        try:
            authed = _header_auth(state, conn, ws)
            start = await _read_start(ws, conn)
            if not authed:
                token = start.custom.get("token")
                if not token:
                    raise AuthError("missing credentials: pass the key as customParameter 'token' or ?token=")
                conn.authenticate(token)  # no header came (else authed): only this token
            settings = tp.call_settings(state.default_settings(), start.custom)
            settings.output_sample_rate = tm.RATE  # the call speaks at the wire's rate
            async with conn.session(settings) as session:
                session.log.info("call %s stream %s (%s, %s)", start.call_id, start.stream_id, start.dialect, start.encoding)
                session.describe(**tp.call_details(start))
                await _Call(ws, conn, session, state, start).run()
        except WebSocketDisconnect:
            return  # the caller (or Twilio) hung up: nothing to close
        except VoicebotError as exc:
            # Twilio has no error message: log it, count it, close with the code as reason.
            code = conn.refuse(exc)
            log.warning("twilio stream refused: %s: %s", exc.code, exc)
            await close_quietly(ws, code, f"{exc.code}: {exc}")
            return
        await close_quietly(ws)  # a hang-up while we close is not an error

    return handle


def _header_auth(state: ServerState, conn: Connection, ws: WebSocket) -> bool:
    """True if authenticated at the upgrade: by Twilio's signature, a header or ?token=
    (Telnyx, tests); False: wait for the token in the start message's parameters."""
    token = _auth_token(state)
    signed = ws.headers.get("x-twilio-signature")
    if token is not None and signed is not None:
        headers = {k.lower(): v for k, v in ws.headers.items()}
        host = ws.headers.get("host") or f"{ws.url.hostname}:{ws.url.port}"
        url = _signed_url(state, ws.url.scheme, headers, host, ws.url.path, ws.url.query)
        if not tp.signature_valid(token, url, (), signed):
            raise AuthError("invalid X-Twilio-Signature")
        return True
    if not state.auth_required:
        if token is not None:  # only Twilio's signature can authenticate this server's calls
            raise AuthError("missing X-Twilio-Signature")
        return True
    query_token = conn.query.get("token")
    if not conn.headers.get("authorization") and not query_token:
        return False
    conn.authenticate(query_token)
    return True


async def _read_start(ws: WebSocket, conn: Connection) -> tp.Start:
    """Skip ``connected`` (and anything else) until ``start``, within 10 s."""
    try:
        async with asyncio.timeout(_START_TIMEOUT_S):
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    raise WebSocketDisconnect(msg.get("code", 1000))
                if msg.get("text") is None:
                    continue
                conn.check_size(len(msg["text"]))
                parsed = tp.parse_message(msg["text"])
                if isinstance(parsed, tp.Start):
                    return parsed
                if isinstance(parsed, tp.Stop):
                    raise WebSocketDisconnect(1000)
    except TimeoutError:
        raise BadMessage(f"no 'start' message within {_START_TIMEOUT_S:g} s") from None


class _Call:
    """One call: reader, writer, pacer and keypad timer, all ended together."""

    def __init__(self, ws: WebSocket, conn: Connection, session: Session, state: ServerState,
                 start: tp.Start) -> None:
        self.ws, self.conn, self.session = ws, conn, session
        self.cfg = state.cfg.telephony
        self.gate = conn.audio_gate()
        # Marks, keys, the rest; plus the echoes of our own marks (one per mark_interval_ms
        # while a reply plays), which a carrier sends back as fast as we send them.
        self.control = conn.control_gate(extra_rate=1000 / self.cfg.mark_interval_ms)
        self.out = tp.Outbound(start.stream_id, start.dialect)
        self.fmt = start.encoding
        self.marks = tp.PlayoutMarks(self.cfg.mark_interval_ms)
        self.framer = tm.Framer()
        self.keypad = tp.DtmfCollector(self.cfg)
        self._keypad_wake = asyncio.Event()
        # The session's own lead (playout_lead_ms) waits in our queue; the pacer adds
        # only this much, so frames leave one per 20 ms, marks right after their audio.
        self._pacer = Pacer(_PACER_LEAD_S)
        # (is media, message) waiting for the pacer. The session produces reply audio
        # in real time and the pacer sends it in real time, so this holds about the
        # lead plus one resampler block; _MAX_QUEUED only trips if the socket stalls.
        self._queue: deque[tuple[bool, str]] = deque()
        self._more = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._playing: str | None = None  # reply whose audio is going out
        self._audio = ReplyResampler(tm.RATE)
        self._bad = 0

    async def run(self) -> None:
        await run_until_first_ends(
            self.conn,
            {
                "twilio-in": self._reader(),
                "twilio-out": self._writer(),
                "keypad": self._keypad_timer(),
                "twilio-pace": self._pace(),
            },
            reason="call ended",
        )

    # ------------------------------------------------------------------ inbound
    async def _reader(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            text = msg.get("text")
            if text is None:
                continue  # Twilio sends no binary frames
            try:
                self.conn.check_size(len(text))
                if self._handle(tp.parse_message(text)):
                    return
            except VoicebotError as exc:
                self._bad += 1
                level = logging.WARNING if self._bad <= _LOGGED_BAD else logging.DEBUG
                self.session.log.log(level, "bad message from the carrier: %s: %s", exc.code, exc)

    def _handle(self, msg: tp.Inbound) -> bool:
        """Act on one message; True when the call is over."""
        if not isinstance(msg, tp.Media):
            self.control.check()  # raises: the reader logs it and drops the message
        match msg:
            case tp.Media(payload, track):
                if track in ("inbound", "inbound_track") and payload:
                    try:
                        self.gate.check(len(payload), tm.RATE)  # G.711: one byte a sample
                    except VoicebotError as exc:
                        if self.gate.report_due():
                            self.session.log.warning("carrier audio refused: %s", exc)
                        return False
                    self.session.push_audio(tm.decode_audio(self.fmt, payload), tm.RATE)
            case tp.MarkEcho(name):
                heard = self.marks.echoed(name)
                if heard is not None:
                    # Kept current so the session's own barge-in cuts at what was heard.
                    self.session.set_played(heard)
            case tp.DtmfPress(digit):
                self.session.emit(ev.Dtmf(digit))
                action = self.keypad.press(digit, time.monotonic())
                if isinstance(action, tp.Hangup):
                    self.session.log.info("caller pressed %s: hanging up", digit)
                    self.conn.end("hangup digit")
                    return True
                if isinstance(action, tp.KeypadEntry):
                    self._to_assistant(action)
                self._keypad_wake.set()
            case tp.Stop():
                self.conn.end("call ended")
                return True
            case tp.Start():
                self.session.log.warning("second 'start' on one stream ignored")
            case tp.Other(event):
                self.session.log.debug("carrier event %r ignored", event)
        return False

    def _to_assistant(self, entry: tp.KeypadEntry) -> None:
        self.session.log.info("keypad entry: %s", entry.digits)
        self.session.add_text("user", entry.text)
        self.session.create_response()  # cuts a reply in progress, like speech would

    async def _keypad_timer(self) -> None:
        """Sends digits typed without the terminator once the caller pauses."""
        while True:
            deadline = self.keypad.deadline()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if deadline is None else max(0.0, deadline - time.monotonic())):
                    await self._keypad_wake.wait()
            self._keypad_wake.clear()
            entry = self.keypad.poll(time.monotonic())
            if entry is not None:
                self._to_assistant(entry)

    # ----------------------------------------------------------------- outbound
    async def _writer(self) -> None:
        async for event in self.session.events():
            match event:
                case ev.ResponseAudio():
                    self._play(event)
                case ev.BargeIn(response_id=rid):
                    await self._cut(rid)
                case ev.ResponseDone(response_id=rid, status="completed"):
                    self._end(rid)
                case ev.ResponseDone(response_id=rid):
                    await self._cut(rid)
                case ev.ErrorEvent(code=code, message=message, fatal=fatal):
                    self.session.log.warning("session error %s: %s", code, message)
                    if fatal:
                        return
            if len(self._queue) > _MAX_QUEUED:
                self.session.log.warning("carrier is not taking audio; ending the call")
                self.conn.end("slow_consumer")
                return

    def _play(self, event: ev.ResponseAudio) -> None:
        if event.response_id != self._playing:
            self._playing = event.response_id
            self.framer.reset()
            # Nothing of this reply is confirmed heard yet; also clears a stale value
            # left by late marks of the previous reply.
            self.session.set_played(0)
            self._enqueue_mark(self.marks.begin(event.response_id))
        self._enqueue(self.framer.push(self._audio.process(event.response_id, event.audio, event.sample_rate)))

    def _enqueue(self, frames: list[np.ndarray]) -> None:
        for frame in frames:
            self._queue.append((True, self.out.media(tm.encode_audio(self.fmt, frame))))
            self._enqueue_mark(self.marks.sent_samples(frame.size))
        self._more.set()

    def _enqueue_mark(self, name: str | None) -> None:
        if name is not None:
            self._queue.append((False, self.out.mark(name)))
            self._more.set()

    def _end(self, response_id: str) -> None:
        if response_id != self._playing:
            return
        self._enqueue(self.framer.push(self._audio.flush()) + self.framer.flush())
        self._enqueue_mark(self.marks.end())
        self._playing = None

    async def _cut(self, response_id: str) -> None:
        if response_id != self._playing:
            return
        heard = self.marks.cut()
        self.session.log.info("reply %s cut after %d ms heard (by marks)", response_id, heard)
        self._queue.clear()  # never sent, so never heard
        self._pacer.reset()
        self._playing = None
        self._audio.reset()
        self.framer.reset()
        await self._send(self.out.clear())

    async def _pace(self) -> None:
        """Sends queued media one 20 ms frame at a time, marks right after their audio."""
        while True:
            if not self._queue:
                self._more.clear()
                await self._more.wait()
                continue
            is_media, text = self._queue[0]
            if is_media:
                delay = self._pacer.delay(time.monotonic())
                if delay > 0:
                    await asyncio.sleep(delay)
                    continue  # the queue may have been cleared meanwhile
                self._pacer.sent()
            self._queue.popleft()
            await self._send(text)

    async def _send(self, text: str) -> None:
        async with self._send_lock:  # the pacer and a clear may send at once
            await self.ws.send_text(text)
