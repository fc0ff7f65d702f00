"""Probe client that calls ``/twilio`` the way Twilio does (docs/telephony.md).

It sends ``connected`` and ``start`` (``--system-prompt``/``--voice`` and the token go
in ``customParameters``), then the caller's audio as μ-law 8 kHz in 160-byte ``media``
frames, one per 20 ms frame the driver sends. Use ``--sample-rate 8000``: at other
rates the soxr stream holds back ~0.1 s of audio, which the latencies then include. Like Twilio it keeps a playback clock
for the reply audio and echoes each ``mark`` once the audio before it has "played",
and on ``clear`` drops its buffer and echoes the remaining marks at once.

The server speaks no native events on this wire, so they are rebuilt from what it
does send: a reply's opening mark -> ``response.started``, its first media ->
``response.audio.started``, its end mark -> ``response.done`` (completed), a
``clear`` -> ``barge_in`` + ``response.done`` (interrupted). No transcripts or
``turn.timings``: latency is measured from the audio, as for every protocol.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections import deque
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from voicebot.audio import Resampler, float_to_pcm16, pcm16_to_float
from voicebot.probe.base import Audio, ClientError, ConnectOptions, Event, Incoming
from voicebot.probe.native import _closed
from voicebot.wire import twilio_media as tp

_REFUSAL_WAIT_S = 0.25  # a refused stream is closed right after 'start'; nothing is sent back


class TwilioClient:
    def __init__(self, options: ConnectOptions) -> None:
        self.options = options
        self.output_rate = tp.RATE
        self.stream_sid = "MZ" + uuid.uuid4().hex
        self.call_sid = "CA" + uuid.uuid4().hex
        self._ws: ClientConnection | None = None
        self._resampler = Resampler(options.sample_rate, tp.RATE)
        self._framer = tp.Framer()
        # 8 kHz frames waiting to go: about one soxr block (5 frames from 16 kHz).
        self._outbox: deque[np.ndarray] = deque()
        self._seq = 0
        self._chunk = 0
        # Items rebuilt from one wire message (at most three) waiting for receive().
        self._items: deque[Incoming] = deque()
        # Marks to echo once played: at most the marks of the audio buffered ahead.
        self._echoes: deque[tuple[float, str]] = deque()
        self._play_end = 0.0  # when the reply audio received so far has played out
        self._reply: str | None = None
        self._reply_audible = False

    def _msg(self, event: str, **body: Any) -> str:
        self._seq += 1
        return json.dumps({"event": event, "sequenceNumber": str(self._seq), "streamSid": self.stream_sid, **body})

    async def connect(self) -> None:
        opts = self.options
        try:
            self._ws = await connect(opts.url, open_timeout=opts.timeout_s, max_size=4 << 20)
        except InvalidStatus as exc:
            raise ClientError(f"WebSocket upgrade refused: HTTP {exc.response.status_code}") from None
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise ClientError(f"cannot connect to {opts.url}: {exc or type(exc).__name__}") from None
        custom = {k: str(v) for k, v in opts.start_fields.items() if v is not None}
        if opts.token:
            custom["token"] = opts.token
        start = {
            "accountSid": "AC" + uuid.uuid4().hex,
            "streamSid": self.stream_sid,
            "callSid": self.call_sid,
            "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": tp.RATE, "channels": 1},
            "customParameters": custom,
        }
        try:
            await self._ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            await self._ws.send(self._msg("start", start=start))
            await asyncio.wait_for(self._ws.wait_closed(), _REFUSAL_WAIT_S)
        except TimeoutError:
            return  # still open: the call is accepted
        except ConnectionClosed as exc:
            raise ClientError(f"stream refused: {_closed(exc)}") from None
        ws = self._ws
        raise ClientError(f"stream refused (code {ws.close_code}): {ws.close_reason or 'no reason given'}")

    async def send_audio(self, pcm: bytes) -> None:
        assert self._ws is not None, "connect() first"
        try:
            await self._send_echoes(time.monotonic())
            self._outbox.extend(self._framer.push(self._resampler.process(pcm16_to_float(pcm))))
            # One frame per call, like a phone: soxr hands out ~5 frames at a time. A
            # backlog (the driver fell behind) drains one extra frame per call.
            for _ in range(min(len(self._outbox), 2 if len(self._outbox) > 5 else 1)):
                frame = self._outbox.popleft()
                self._chunk += 1
                media = {
                    "track": "inbound",
                    "chunk": str(self._chunk),
                    "timestamp": str(20 * (self._chunk - 1)),
                    "payload": base64.b64encode(tp.encode_audio("audio/pcmu", frame)).decode("ascii"),
                }
                await self._ws.send(self._msg("media", media=media))
        except ConnectionClosed as exc:
            raise _closed(exc) from None

    async def send_dtmf(self, digit: str) -> None:
        """A keypress, as Twilio reports it (for tests and manual probing)."""
        assert self._ws is not None, "connect() first"
        try:
            await self._ws.send(self._msg("dtmf", dtmf={"track": "inbound_track", "digit": digit}))
        except ConnectionClosed as exc:
            raise _closed(exc) from None

    async def _send_echoes(self, now: float) -> None:
        assert self._ws is not None
        while self._echoes and self._echoes[0][0] <= now:
            _, name = self._echoes.popleft()
            await self._ws.send(self._msg("mark", mark={"name": name}))

    async def receive(self) -> Incoming:
        assert self._ws is not None, "connect() first"
        while not self._items:
            try:
                raw = await self._ws.recv()
            except ConnectionClosed as exc:
                raise _closed(exc) from None
            t = time.monotonic()
            try:
                data = json.loads(raw)
                self._translate(data, t)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                msg = {"type": "error", "code": "probe_bad_message", "message": f"{exc}: {str(raw)[:200]}"}
                self._items.append(Event(msg, t))
        return self._items.popleft()

    def _event(self, t: float, **data: Any) -> None:
        self._items.append(Event(data, t))

    def _translate(self, data: dict[str, Any], t: float) -> None:
        kind = data["event"]
        if kind == "media":
            audio = tp.decode_audio("audio/pcmu", base64.b64decode(data["media"]["payload"]))
            self._play_end = max(self._play_end, t) + audio.size / tp.RATE
            if self._reply is not None and not self._reply_audible:
                self._reply_audible = True
                self._event(t, type="response.audio.started", response_id=self._reply, item_id="")
            self._items.append(Audio(float_to_pcm16(audio), t))
        elif kind == "mark":
            name = str(data["mark"]["name"])
            self._echoes.append((max(self._play_end, t), name))
            parsed = tp.parse_mark(name)
            if parsed is None:
                return
            rid, ms, end = parsed
            if end:
                self._reply = None
                self._event(t, type="response.done", response_id=rid, item_id="", status="completed", text="", full_text="", played_ms=ms)
            elif ms == 0:
                self._reply, self._reply_audible = rid, False
                self._event(t, type="response.started", response_id=rid, item_id="")
        elif kind == "clear":
            # Twilio empties its buffer and returns the dropped marks at once.
            self._echoes = deque((t, name) for _, name in self._echoes)
            self._play_end = t
            if self._reply is not None:
                rid, self._reply = self._reply, None
                self._event(t, type="barge_in", response_id=rid, played_ms=None, heard_text="")
                self._event(t, type="response.done", response_id=rid, item_id="", status="interrupted", text="", full_text="", played_ms=None)

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        # Best effort, as Twilio does at hang-up: 'stop', then close.
        with contextlib.suppress(ConnectionClosed, OSError):
            await ws.send(self._msg("stop", stop={"accountSid": "", "callSid": self.call_sid}))
        with contextlib.suppress(ConnectionClosed, OSError):
            await ws.close()
