"""Probe client for the OpenAI Realtime protocol (``/v1/realtime``, docs/realtime.md).

Speaks GA Realtime events on the wire and hands the probe native events
(``transcript.final``, ``response.audio.started``, ``response.done``, ``barge_in``...),
so the shared turn logic does not know which protocol it measured. Audio travels as
``audio/pcm`` at 24 kHz, or ``audio/pcmu`` when the probe runs at 8 kHz; other rates
are converted here with stateful resamplers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections import deque
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from voicebot.audio import Resampler, float_to_pcm16, pcm16_to_float
from voicebot.probe.base import Audio, ClientError, ConnectOptions, Event, Incoming
from voicebot.probe.native import _closed
from voicebot.wire import g711

_PCM_RATE = 24_000


def _status(response: dict[str, Any]) -> str:
    """Realtime response status -> native ``response.done`` status."""
    status = response.get("status")
    reason = (response.get("status_details") or {}).get("reason")
    if status == "cancelled":
        return "interrupted" if reason == "turn_detected" else "cancelled"
    return "completed" if status in ("completed", "incomplete") else "failed"


def _transcript(response: dict[str, Any]) -> str:
    for item in response.get("output") or []:
        for part in item.get("content") or []:
            text = part.get("transcript") or part.get("text")
            if text:
                return str(text)
    return ""


class RealtimeClient:
    def __init__(self, options: ConnectOptions) -> None:
        self.options = options
        self._wire_in = g711.RATE if options.sample_rate == g711.RATE else _PCM_RATE
        self._wire_out = g711.RATE if options.output_sample_rate == g711.RATE else _PCM_RATE
        self.output_rate = options.output_sample_rate or self._wire_out
        self._send_rs = Resampler(options.sample_rate, self._wire_in)
        self._recv_rs = Resampler(self._wire_out, self.output_rate)
        self._ws: ClientConnection | None = None
        self._pending: deque[Incoming] = deque()  # one wire event may become two items
        self._audio_started: set[str] = set()
        self._partials: dict[str, str] = {}
        self.session_id: str | None = None

    def _fmt(self, rate: int) -> dict[str, Any]:
        return {"type": "audio/pcmu"} if rate == g711.RATE else {"type": "audio/pcm", "rate": _PCM_RATE}

    async def connect(self) -> None:
        opts = self.options
        headers = {"Authorization": f"Bearer {opts.token}"} if opts.token else None
        try:
            self._ws = await connect(opts.url, additional_headers=headers, open_timeout=opts.timeout_s,
                                     max_size=4 << 20)
        except InvalidStatus as exc:
            raise ClientError(f"WebSocket upgrade refused: HTTP {exc.response.status_code}") from None
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise ClientError(f"cannot connect to {opts.url}: {exc or type(exc).__name__}") from None
        fields = opts.start_fields
        output: dict[str, Any] = {"format": self._fmt(self._wire_out)}
        if fields.get("voice"):
            output["voice"] = fields["voice"]
        session: dict[str, Any] = {
            "type": "realtime",
            "audio": {"input": {"format": self._fmt(self._wire_in),
                                "turn_detection": {"type": "server_vad"}}, "output": output},
        }
        if fields.get("system_prompt"):
            session["instructions"] = fields["system_prompt"]
        if fields.get("max_tokens"):
            session["max_output_tokens"] = fields["max_tokens"]
        try:
            async with asyncio.timeout(opts.timeout_s):
                await self._expect("session.created")
                await self._ws.send(json.dumps({"type": "session.update", "session": session}))
                data = await self._expect("session.updated")
        except ConnectionClosed as exc:
            raise _closed(exc) from None
        except TimeoutError:
            raise ClientError(f"no session.created/updated within {opts.timeout_s:g} s") from None
        self.session_id = data.get("session", {}).get("id")

    async def _expect(self, kind: str) -> dict[str, Any]:
        assert self._ws is not None
        data = json.loads(await self._ws.recv())
        if data.get("type") == "error":
            err = data.get("error") or {}
            raise ClientError(f"session refused: {err.get('code')}: {err.get('message')}")
        if data.get("type") != kind:
            raise ClientError(f"expected {kind}, got {str(data)[:200]!r}")
        return data  # type: ignore[no-any-return]

    async def send_audio(self, pcm: bytes) -> None:
        assert self._ws is not None, "connect() first"
        data = float_to_pcm16(self._send_rs.process(pcm16_to_float(pcm)))
        if self._wire_in == g711.RATE:
            data = g711.encode("audio/pcmu", data)
        body = {"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()}
        try:
            await self._ws.send(json.dumps(body))
        except ConnectionClosed as exc:
            raise _closed(exc) from None

    async def receive(self) -> Incoming:
        assert self._ws is not None, "connect() first"
        while not self._pending:
            try:
                msg = await self._ws.recv()
            except ConnectionClosed as exc:
                raise _closed(exc) from None
            try:
                data = json.loads(msg)
            except json.JSONDecodeError:
                data = {"type": "error", "error": {"code": "probe_bad_json", "message": str(msg)[:200]}}
            self._translate(data if isinstance(data, dict) else {}, time.monotonic())
        return self._pending.popleft()

    def _event(self, t: float, **data: Any) -> None:
        self._pending.append(Event(data, t))

    def _translate(self, d: dict[str, Any], t: float) -> None:
        kind = d.get("type")
        item_id = d.get("item_id")
        if kind == "response.output_audio.delta":
            rid = str(d.get("response_id"))
            if rid not in self._audio_started:
                self._audio_started.add(rid)
                self._event(t, type="response.audio.started", response_id=rid, item_id=item_id)
            raw = base64.b64decode(d.get("delta") or "")
            if self._wire_out == g711.RATE:
                raw = g711.decode("audio/pcmu", raw)
            self._pending.append(Audio(float_to_pcm16(self._recv_rs.process(pcm16_to_float(raw))), t))
        elif kind == "input_audio_buffer.speech_started":
            self._event(t, type="speech.started", audio_ms=d.get("audio_start_ms"), item_id=item_id)
        elif kind == "input_audio_buffer.speech_stopped":
            self._event(t, type="speech.stopped", audio_ms=d.get("audio_end_ms"), item_id=item_id)
        elif kind == "conversation.item.input_audio_transcription.delta":
            text = self._partials.get(str(item_id), "") + str(d.get("delta") or "")
            self._partials[str(item_id)] = text
            self._event(t, type="transcript.partial", item_id=item_id, confirmed=text, tentative="", text=text)
        elif kind == "conversation.item.input_audio_transcription.completed":
            self._partials.pop(str(item_id), None)
            self._event(t, type="transcript.final", item_id=item_id, text=d.get("transcript", ""))
        elif kind == "response.created":
            self._event(t, type="response.started", response_id=d["response"].get("id"), item_id=None)
        elif kind == "response.output_audio_transcript.delta":
            self._event(t, type="response.text.delta", response_id=d.get("response_id"), item_id=item_id,
                        text=d.get("delta", ""))
        elif kind == "response.done":
            resp = d.get("response") or {}
            done_id, status, said = resp.get("id"), _status(resp), _transcript(resp)
            self._audio_started.discard(str(done_id))
            if status == "interrupted":
                self._event(t, type="barge_in", response_id=done_id, played_ms=None, heard_text=said)
            usage = resp.get("usage") or {}
            self._event(t, type="response.done", response_id=done_id, item_id=None, status=status,
                        text=said, full_text=said, played_ms=None, input_tokens=usage.get("input_tokens"),
                        cached_tokens=(usage.get("input_token_details") or {}).get("cached_tokens"))
        elif kind == "error":
            err = d.get("error") or {}
            self._event(t, type="error", code=err.get("code"), message=err.get("message"),
                        event_id=err.get("event_id"), fatal=False)
        # Everything else (item bookkeeping, session.updated...) has no native counterpart.

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        with contextlib.suppress(ConnectionClosed, OSError):
            await ws.close()

