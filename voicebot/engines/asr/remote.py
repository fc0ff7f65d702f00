"""The frontend half of the shared ASR service (``asr.backend: remote``).

One GPU serves more callers when ONE Whisper engine batches every frontend's streams
(docs/gpu-results.md, 2026-11-23 third session: four frontends with an engine each
time-sliced the GPU). ``voicebot asr-serve`` (:mod:`voicebot.asr_service`) hosts that
engine; this module is what a frontend runs instead of a local one.

The split: everything per call stays here. :class:`RemoteAsrEngine` is the shared
:class:`~voicebot.engines.asr.engine.AsrEngine` with the same streams (partials every
``partial_interval_ms``, LocalAgreement, the forced prefix, reuse of the partial that saw
the end of speech, the bounded finals-first queue), built with :class:`RemoteDecoder`.
Only a decode --
audio, forced prefix, language, priority in; the text after the prefix out -- goes to
the service, over one multiplexed WebSocket per frontend (:class:`AsrServiceClient`).

vLLM's own ``/v1/audio/transcriptions`` does not fit: its ``prompt`` goes before
``<|startoftranscript|>`` as previous-text context, not as a forced prefix after
``<|notimestamps|>`` (what stable partials need), it has no priority for finals over
partials, and every decode would be a multipart upload of an encoded file.

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

from voicebot.config import AsrConfig, RemoteAsrConfig
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.asr.jobs import (
    DecodeAbandoned,
    DecodeDropped,
    DecodeFailed,
    DecodeJob,
    Priority,
    unless_abandoned,
)
from voicebot.errors import EngineError
from voicebot.services.wire import (
    CONNECT_ERRORS,
    ServiceClient,
    ServiceLost,
    connect_at_start,
    pack_frame,
    samples_of,
    split_frame,
)

__all__ = [
    "PROTOCOL",
    "AsrServiceClient",
    "PartialDropped",
    "RemoteAsrEngine",
    "RemoteDecoder",
    "ServiceLost",
    "pack_decode",
    "unpack_decode",
]

log = logging.getLogger(__name__)

PROTOCOL = 1
# 30 s of float32 audio is 1.92 MB; the header is small.
MAX_FRAME = 4 * 1024 * 1024


class PartialDropped(Exception):
    """The service's queue had no room for a partial."""


def pack_decode(job_id: int, priority: Priority, prefix: str, language: str | None, audio: np.ndarray) -> bytes:
    header = {"type": "decode", "id": job_id, "priority": int(priority), "prefix": prefix, "language": language}
    return pack_frame(header, audio)


def unpack_decode(frame: bytes) -> tuple[dict[str, Any], np.ndarray]:
    """The header and audio of a decode frame; ValueError when it is malformed."""
    header, body = split_frame(frame, "decode")
    if header.get("priority") not in (int(Priority.FINAL), int(Priority.PARTIAL)):
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

    def __init__(self, cfg: RemoteAsrConfig) -> None:
        super().__init__(cfg)
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
        self, audio: np.ndarray, prefix: str, language: str | None, priority: Priority
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
        self, audio: np.ndarray, prefix: str, language: str | None, priority: Priority
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
            try:
                async with asyncio.timeout(self.cfg.decode_timeout_s):
                    return await fut
            except TimeoutError:
                self._send_soon(ws, {"type": "cancel", "id": job_id})
                raise EngineError(
                    f"ASR service gave no result in {self.cfg.decode_timeout_s:g} s", code="asr_timeout"
                ) from None
        except asyncio.CancelledError:
            self._send_soon(ws, {"type": "cancel", "id": job_id})
            raise
        finally:
            self._pending.pop(job_id, None)


class RemoteDecoder:
    """A :class:`~voicebot.engines.asr.jobs.Decoder`: each decode goes to the shared ASR
    service over one multiplexed connection (:class:`AsrServiceClient`)."""

    name = "asr-remote"

    def __init__(self, cfg: RemoteAsrConfig, client: AsrServiceClient) -> None:
        self.cfg = cfg
        self.client = client
        self.in_flight = 0  # decodes sent to the service and not answered
        self._running: dict[DecodeJob, asyncio.Task[tuple[str, float]]] = {}
        self._last_partial_warning = -1e9  # monotonic time of the last failed-partial log line

    @property
    def slots(self) -> int:
        # As for vLLM, one slot per decode in flight: the service bounds its own queue,
        # this count bounds ours.
        return self.cfg.concurrency

    async def start(self) -> None:
        cfg = self.cfg
        took = await connect_at_start(self.client, cfg.startup_timeout_s)
        hello = self.client.hello or {}
        log.info("ASR: the shared service at %s (%s, %s) in %.1f s, %d decode slots",
                 cfg.url, hello.get("backend"), hello.get("model"), took, cfg.concurrency)

    async def aclose(self) -> None:
        await self.client.aclose()

    def abandon(self, job: DecodeJob) -> None:
        """A superseded partial (finalize, reset, close): its decode is cancelled at the service."""
        task = self._running.get(job)
        if task is not None:
            task.cancel()

    async def decode(self, job: DecodeJob) -> tuple[str, float]:
        decode = asyncio.ensure_future(self._decode_remote(job))
        self._running[job] = decode
        try:
            if job.future is None:
                return await self._partial(decode)
            return await self._final(job, decode)
        finally:
            self._running.pop(job, None)

    async def _decode_remote(self, job: DecodeJob) -> tuple[str, float]:
        assert job.audio is not None
        self.in_flight += 1
        try:
            return await self.client.decode(job.audio, job.prefix, job.language, job.priority)
        finally:
            self.in_flight -= 1

    async def _partial(self, decode: asyncio.Future[tuple[str, float]]) -> tuple[str, float]:
        try:
            return await decode
        except PartialDropped:
            raise DecodeDropped from None
        except EngineError as exc:
            # Counted as any failed decode (the supervisor's failure streak), but with the
            # service down every caller's partials fail: one log line per 10 s, not a
            # traceback per decode. A final's failure still goes to its waiter.
            now = time.monotonic()
            if now - self._last_partial_warning >= 10.0:
                self._last_partial_warning = now
                log.warning("ASR partial decodes failing: %s", exc)
            raise DecodeFailed from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the engine is closing
            raise DecodeAbandoned from None  # superseded (abandon): nothing to report

    async def _final(self, job: DecodeJob, decode: asyncio.Future[tuple[str, float]]) -> tuple[str, float]:
        assert job.future is not None
        try:
            return await unless_abandoned(decode, job.future)
        except PartialDropped:  # the service never drops finals; be safe all the same
            raise EngineError("ASR service dropped a final decode", code="asr_unavailable") from None


class RemoteAsrEngine(AsrEngine):
    """The shared :class:`~voicebot.engines.asr.engine.AsrEngine` with a :class:`RemoteDecoder`:
    it adds nothing to the engine but the decoder it is built with, and views of it."""

    def __init__(
        self,
        cfg: AsrConfig,
        model_path: str = "",
        *,
        agreement_n: int = 3,
        client: AsrServiceClient | None = None,
    ) -> None:
        self._remote = RemoteDecoder(cfg.remote, client or AsrServiceClient(cfg.remote))
        super().__init__(cfg, model_path or cfg.remote.url, agreement_n=agreement_n, decoder=self._remote)

    @property
    def client(self) -> AsrServiceClient:
        return self._remote.client

    @property
    def in_flight(self) -> int:
        """Decodes sent to the service and not answered."""
        return self._remote.in_flight
