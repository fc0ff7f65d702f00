"""Probe client for the native protocol at ``/ws`` (docs/protocol.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.frames import Close
from websockets.protocol import State

from voicebot.probe.base import Audio, ClientClosed, ClientError, ConnectOptions, Event, Incoming

# Bytes queued in the socket before send_audio_nowait holds a frame back (~2 s of audio
# at 16 kHz): a server that stops reading shows up as skipped frames, not a stuck probe.
_WRITE_BUFFER_LIMIT = 64 * 1024


def _closed(exc: ConnectionClosed) -> ClientClosed:
    return _describe_close(exc.rcvd)


def _describe_close(rcvd: Close | None) -> ClientClosed:
    if rcvd is None:
        return ClientClosed("connection lost without a close frame")
    return ClientClosed(
        f"server closed the connection (code {rcvd.code}{': ' + rcvd.reason if rcvd.reason else ''})"
    )


class NativeClient:
    def __init__(self, options: ConnectOptions) -> None:
        self.options = options
        self.output_rate = options.output_sample_rate or options.sample_rate
        self.session_id: str | None = None
        self._ws: ClientConnection | None = None

    async def connect(self) -> None:
        opts = self.options
        headers = {"Authorization": f"Bearer {opts.token}"} if opts.token else None
        try:
            self._ws = await connect(
                opts.url,
                additional_headers=headers,
                open_timeout=opts.timeout_s,
                max_size=4 << 20,
            )
        except InvalidStatus as exc:
            raise ClientError(
                f"WebSocket upgrade refused: HTTP {exc.response.status_code}"
            ) from None
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise ClientError(
                f"cannot connect to {opts.url}: {exc or type(exc).__name__}"
            ) from None
        start = {
            "type": "session.start",
            "sample_rate": opts.sample_rate,
            **({"output_sample_rate": opts.output_sample_rate} if opts.output_sample_rate else {}),
            **opts.start_fields,
        }
        try:
            await self._ws.send(json.dumps(start))
            reply = await asyncio.wait_for(self._ws.recv(), opts.timeout_s)
        except ConnectionClosed as exc:
            raise _closed(exc) from None
        except TimeoutError:
            raise ClientError(f"no session.started within {opts.timeout_s:g} s") from None
        data = json.loads(reply) if isinstance(reply, str) else {}
        if data.get("type") == "error":
            raise ClientError(f"session refused: {data.get('code')}: {data.get('message')}")
        if data.get("type") != "session.started":
            raise ClientError(f"expected session.started, got {str(reply)[:200]!r}")
        self.session_id = data.get("session_id")
        self.output_rate = int(data.get("output_sample_rate") or self.output_rate)

    async def send_audio(self, pcm: bytes) -> None:
        assert self._ws is not None, "connect() first"
        try:
            await self._ws.send(pcm)
        except ConnectionClosed as exc:
            raise _closed(exc) from None

    def send_audio_nowait(self, pcm: bytes) -> bool:
        """:meth:`send_audio` without a coroutine: write the frame to the socket now.

        The probe's frame clock calls this for hundreds of sessions every 20 ms; an
        awaited ``send`` per frame was most of its CPU. False when the socket's write
        buffer is full (the frame is held back); ClientClosed once the connection is
        closing.
        """
        ws = self._ws
        assert ws is not None, "connect() first"
        if ws.protocol.state is not State.OPEN:
            raise _describe_close(ws.protocol.close_rcvd)
        if ws.transport.get_write_buffer_size() > _WRITE_BUFFER_LIMIT:
            return False
        ws.protocol.send_binary(pcm)
        ws.send_data()
        return True

    async def receive(self) -> Incoming:
        assert self._ws is not None, "connect() first"
        try:
            msg = await self._ws.recv()
        except ConnectionClosed as exc:
            raise _closed(exc) from None
        t = time.monotonic()
        if isinstance(msg, bytes):
            return Audio(msg, t)
        try:
            data = json.loads(msg)
        except json.JSONDecodeError:
            data = {"type": "error", "code": "probe_bad_json", "message": msg[:200]}
        if not isinstance(data, dict):
            data = {"type": "error", "code": "probe_bad_json", "message": str(data)[:200]}
        return Event(data, t)

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        # Best effort: the server may already be gone; close() is bounded by its own timeout.
        with contextlib.suppress(ConnectionClosed, OSError):
            await ws.send(json.dumps({"type": "session.end"}))
        with contextlib.suppress(ConnectionClosed, OSError):
            await ws.close()
