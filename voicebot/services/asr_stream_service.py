"""``voicebot asr-serve`` with a streaming engine (``asr.remote.engine: fastconformer``): every
frontend's call streams in ONE engine, whose batched step takes them all.

The service holds each call's stream (its encoder state is in the engine's slots) and
speaks :mod:`.asr_stream_client`'s protocol: audio frames carry every stream of a
frontend, partials go back batched per connection (the newest of each stream), a final
when it is asked for. A closed connection closes its streams and frees their slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.server import ServerConnection

from voicebot.engines.asr.fastconformer import FastConformerAsr, FastConformerStream
from voicebot.errors import CapacityError, VoicebotError
from voicebot.services.asr_stream_client import PROTOCOL, unpack_audio
from voicebot.services.wire import is_id

__all__ = ["StreamService", "StreamStats"]

log = logging.getLogger(__name__)


@dataclass
class StreamStats:
    connections: int = 0
    open_connections: int = 0
    open_streams: int = 0
    refused_streams: int = 0
    finals: int = 0
    partials: int = 0
    failed: int = 0
    bad_requests: int = 0

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class _Stream:
    sid: int
    stream: FastConformerStream
    utt: int
    forward: asyncio.Task[None] | None = None
    finals: set[asyncio.Task[None]] = field(default_factory=set)


@dataclass(eq=False)
class _Conn:
    ws: ServerConnection
    streams: dict[int, _Stream] = field(default_factory=dict)
    partials: dict[int, list[Any]] = field(default_factory=dict)  # newest per stream, not yet sent
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False


class StreamService:
    """The WebSocket handler around one started streaming engine."""

    def __init__(self, engine: FastConformerAsr, *, backend: str = "fastconformer") -> None:
        self.engine = engine
        self.backend = backend
        self.stats = StreamStats()
        # Streams one connection may hold: the engine's slots bound them all.
        self.max_streams = engine.fc.max_streams

    async def aclose(self) -> None:
        """Nothing of its own to close: each connection's handler closes its streams."""

    async def handler(self, ws: ServerConnection) -> None:
        conn = _Conn(ws)
        self.stats.connections += 1
        self.stats.open_connections += 1
        sender = asyncio.create_task(self._send_partials(conn), name="asr-streams-partials")
        try:
            await ws.send(json.dumps({
                "type": "hello", "service": "asr", "protocol": PROTOCOL, "mode": "streams",
                "backend": self.backend, "model": self.engine.model_path, "slots": self.max_streams,
                "chunk_ms": self.engine.chunk_ms,
            }))
            async for msg in ws:
                if isinstance(msg, str):
                    await self._on_text(conn, msg)
                else:
                    await self._on_audio(conn, msg)
        except websockets.ConnectionClosed:
            pass
        finally:
            conn.closed = True
            self.stats.open_connections -= 1
            sender.cancel()
            for entry in list(conn.streams.values()):
                await self._close(conn, entry)
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    # -- control ------------------------------------------------------------------------

    async def _on_text(self, conn: _Conn, msg: str) -> None:
        try:
            data = json.loads(msg)
        except json.JSONDecodeError:
            data = None
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "stats":
            await self._send(conn, {"type": "stats", **self.snapshot()})
            return
        sid = data.get("stream") if isinstance(data, dict) else None
        if kind not in ("open", "finalize", "reset", "close") or not is_id(sid):
            await self._bad(conn, None, None, "unknown message")
            return
        assert isinstance(data, dict)
        if kind == "open":
            await self._open(conn, sid, data.get("utt", 0))
            return
        entry = conn.streams.get(sid)
        if entry is None:
            # A stream refused at open (the frontend knows) or never opened.
            if kind == "finalize":
                await self._bad(conn, sid, data.get("id"), "no such stream", code="asr_unavailable")
            return
        if kind == "finalize":
            fid = data.get("id")
            if not is_id(fid):
                await self._bad(conn, sid, None, "finalize id must be an integer")
                return
            task = asyncio.create_task(self._final(conn, entry, fid), name="asr-streams-final")
            entry.finals.add(task)
            task.add_done_callback(entry.finals.discard)
        elif kind == "reset":
            entry.stream.reset()
            entry.utt += 1
            self._restart_forward(conn, entry)
        else:
            await self._close(conn, entry)

    async def _open(self, conn: _Conn, sid: int, utt: object) -> None:
        if sid in conn.streams or not is_id(utt):
            await self._bad(conn, sid, None, "duplicate stream or bad utt")
            return
        try:
            if len(conn.streams) >= self.max_streams:
                raise CapacityError(f"{self.max_streams} streams on one connection")
            stream = self.engine.stream()
        except CapacityError as exc:
            self.stats.refused_streams += 1
            await self._send(conn, {"type": "error", "stream": sid, "id": None, "code": "capacity_exceeded",
                                    "message": str(exc)})
            return
        except VoicebotError as exc:
            await self._send(conn, {"type": "error", "stream": sid, "id": None, "code": exc.code, "message": str(exc)})
            return
        entry = _Stream(sid, stream, utt)
        conn.streams[sid] = entry
        self.stats.open_streams += 1
        self._restart_forward(conn, entry)

    async def _close(self, conn: _Conn, entry: _Stream) -> None:
        if conn.streams.pop(entry.sid, None) is None:
            return
        self.stats.open_streams -= 1
        conn.partials.pop(entry.sid, None)
        tasks = [t for t in (entry.forward, *entry.finals) if t is not None]
        for task in tasks:
            task.cancel()
        await entry.stream.aclose()  # its slot is free again
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- audio in, partials and finals out --------------------------------------------------

    async def _on_audio(self, conn: _Conn, frame: bytes) -> None:
        try:
            chunks = unpack_audio(frame)
        except ValueError as exc:
            await self._bad(conn, None, None, str(exc), code="invalid_request")
            return
        for sid, audio in chunks:
            entry = conn.streams.get(sid)
            if entry is not None and audio.size:  # not a stream refused at open
                entry.stream.push(audio)

    def _restart_forward(self, conn: _Conn, entry: _Stream) -> None:
        # A new iteration per utterance: a partial taken from the stream just before a reset
        # dies with the old task instead of going out tagged with the new utterance.
        if entry.forward is not None:
            entry.forward.cancel()
        conn.partials.pop(entry.sid, None)
        entry.forward = asyncio.create_task(self._forward(conn, entry, entry.utt), name="asr-streams-forward")

    async def _forward(self, conn: _Conn, entry: _Stream, utt: int) -> None:
        async for p in entry.stream:
            conn.partials[entry.sid] = [entry.sid, utt, p.confirmed, p.tentative, round(p.audio_s, 3)]
            conn.wake.set()

    async def _send_partials(self, conn: _Conn) -> None:
        while True:
            await conn.wake.wait()
            conn.wake.clear()
            if not conn.partials:
                continue
            items, conn.partials = list(conn.partials.values()), {}
            self.stats.partials += len(items)
            await self._send(conn, {"type": "partials", "items": items})

    async def _final(self, conn: _Conn, entry: _Stream, fid: int) -> None:
        try:
            t = await entry.stream.finalize()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.failed += 1
            code = exc.code if isinstance(exc, VoicebotError) else "engine_error"
            await self._send(conn, {"type": "error", "stream": entry.sid, "id": fid, "code": code, "message": str(exc)})
            return
        self.stats.finals += 1
        await self._send(conn, {"type": "final", "stream": entry.sid, "id": fid, "text": t.text,
                                "audio_s": round(t.audio_s, 3), "decode_s": round(t.decode_s, 6)})

    async def _bad(self, conn: _Conn, sid: int | None, fid: object, message: str, *, code: str = "invalid_event") -> None:
        self.stats.bad_requests += 1
        await self._send(conn, {"type": "error", "stream": sid, "id": fid if is_id(fid) else None, "code": code,
                                "message": message})

    async def _send(self, conn: _Conn, payload: dict[str, Any]) -> None:
        if conn.closed:
            return
        with contextlib.suppress(websockets.ConnectionClosed):
            await conn.ws.send(json.dumps(payload))

    def snapshot(self) -> dict[str, Any]:
        engine = self.engine
        return {**self.stats.as_json(), "queue_depth": engine.queue_depth, "running": self.stats.open_streams,
                "free_slots": engine.free_slots, **engine.step_stats()}
