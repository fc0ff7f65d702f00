"""The client of the shared ASR service (``voicebot asr-serve``, :mod:`.asr_service`), and
its wire format: what a frontend's :class:`~voicebot.engines.asr.remote.RemoteDecoder`
sends each decode over.

Wire format (protocol 1):

- frontend -> service, binary: 4-byte big-endian header length, a JSON header
  ``{"type": "decode", "id", "priority": 0 final | 1 partial, "prefix", "language"}``,
  then the audio as little-endian float32, 16 kHz mono (what the stream holds: no
  requantisation, the same transcript as in-process);
- frontend -> service, text: ``{"type": "cancel", "id"}`` (a final nobody waits for, a
  partial superseded by ``reset()``, a stream closed at the end of the call);
- service -> frontend, text: ``{"type": "hello", "service": "asr", "protocol", "backend", "model", "slots"}``
  once, then ``{"type": "result", "id", "text", "decode_s"}`` or
  ``{"type": "error", "id", "code", "message"}`` (``code: "dropped"``: no room for a
  partial; it is retried on the stream's next audio, as a local engine's would be).

Failures: a connection lost before a decode's result is retried (``asr.remote.retries``,
on a new connection); a result is never asked for twice once it came. When the service
stays unreachable the decode fails with ``EngineError(code="asr_unavailable")``: a final's
waiter (the session) gets it and sends the caller an error event; a partial is skipped.
A decode with no answer within ``decode_timeout_s`` fails with ``asr_timeout``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Any

import numpy as np
import websockets

from voicebot.config import RemoteAsrConfig
from voicebot.errors import EngineError
from voicebot.runtime.loop_lag import LoopLateness
from voicebot.services.wire import (
    CONNECT_ERRORS,
    ServiceClient,
    ServiceLost,
    pack_frame,
    samples_of,
    split_frame,
)

__all__ = ["FINAL", "MAX_FRAME", "PARTIAL", "PROTOCOL", "AsrServiceClient", "PartialDropped", "pack_decode", "unpack_decode"]

log = logging.getLogger(__name__)

# A decode's priority on the wire (the engine's jobs.Priority has the same values).
FINAL, PARTIAL = 0, 1
PROTOCOL = 1
# 30 s of float32 audio is 1.92 MB; the header is small.
MAX_FRAME = 4 * 1024 * 1024


class PartialDropped(Exception):
    """The service's queue had no room for a partial."""


def pack_decode(job_id: int, priority: int, prefix: str, language: str | None, audio: np.ndarray) -> bytes:
    header = {"type": "decode", "id": job_id, "priority": int(priority), "prefix": prefix, "language": language}
    return pack_frame(header, audio)


def unpack_decode(frame: bytes) -> tuple[dict[str, Any], np.ndarray]:
    """The header and audio of a decode frame; ValueError when it is malformed."""
    header, body = split_frame(frame, "decode")
    if header.get("priority") not in (FINAL, PARTIAL):
        raise ValueError("decode priority must be 0 (final) or 1 (partial)")
    if not isinstance(header.get("prefix", ""), str):
        raise ValueError("decode prefix must be a string")
    language = header.get("language")
    if language is not None and not isinstance(language, str):
        raise ValueError("decode language must be a string or null")
    return header, samples_of(body, "decode")


class AsrServiceClient(ServiceClient):
    """One multiplexed WebSocket to the ASR service: many decodes in flight, matched by id."""

    what = "ASR service"
    service = "asr"
    protocol = PROTOCOL
    max_size = MAX_FRAME
    hint = " (asr.remote.engine names a Whisper engine: does the service host a streaming one?)"

    def __init__(self, cfg: RemoteAsrConfig, *, loop: LoopLateness | None = None) -> None:
        super().__init__(cfg, loop=loop)
        self.cfg: RemoteAsrConfig = cfg
        self._pending: dict[int, asyncio.Future[tuple[str, float]]] = {}

    def _on_message(self, msg: str | bytes) -> None:
        if isinstance(msg, bytes):
            return
        data = json.loads(msg)
        fut = self._pending.pop(data.get("id"), None)
        if fut is None or fut.done():
            return  # cancelled meanwhile
        if data.get("type") == "result":
            fut.set_result((str(data.get("text", "")), float(data.get("decode_s", 0.0))))
        elif data.get("code") == "dropped":
            fut.set_exception(PartialDropped())
        else:
            code = str(data.get("code") or "engine_error")
            fut.set_exception(EngineError(f"ASR service: {data.get('message', code)}", code=code))

    def _lose_all(self, lost: ServiceLost) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(lost)

    async def decode(
        self, audio: np.ndarray, prefix: str, language: str | None, priority: int
    ) -> tuple[str, float]:
        """The text after ``prefix`` and the service's decode time; cancelling it cancels
        the decode at the service."""
        cfg = self.cfg
        for attempt in itertools.count():
            try:
                return await self._decode_once(audio, prefix, language, priority)
            except ServiceLost as exc:
                if attempt >= cfg.retries or self._closed:
                    raise EngineError(f"ASR service {cfg.url} unavailable: {exc}", code="asr_unavailable") from exc
                log.info("ASR service: %s; retry %d", exc, attempt + 1)
                await asyncio.sleep(cfg.retry_backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def _decode_once(
        self, audio: np.ndarray, prefix: str, language: str | None, priority: int
    ) -> tuple[str, float]:
        try:
            await self.connect()
        except CONNECT_ERRORS as exc:
            raise ServiceLost(f"cannot connect to {self.cfg.url}: {exc}") from exc
        ws = self._ws
        if ws is None:
            raise ServiceLost(f"connection to {self.cfg.url} lost")
        job_id = next(self._ids)
        fut: asyncio.Future[tuple[str, float]] = asyncio.get_running_loop().create_future()
        self._pending[job_id] = fut
        try:
            try:
                await ws.send(pack_decode(job_id, priority, prefix, language, audio))
            except websockets.ConnectionClosed as exc:
                raise ServiceLost(f"connection to {self.cfg.url} lost: {exc}") from exc
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.cfg.decode_timeout_s):
                    return await fut
            except TimeoutError:
                self._send_soon(ws, {"type": "cancel", "id": job_id})
                raise self._timed_out(
                    f"ASR service gave no result in {self.cfg.decode_timeout_s:g} s", "asr_timeout", started
                ) from None
        except asyncio.CancelledError:
            self._send_soon(ws, {"type": "cancel", "id": job_id})
            raise
        finally:
            self._pending.pop(job_id, None)
