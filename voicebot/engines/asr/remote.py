"""The frontend half of the shared ASR service (``asr.backend: remote``).

One GPU serves more callers when ONE Whisper engine batches every frontend's streams
(docs/gpu-results.md, 2026-11-23 third session: four frontends with an engine each
time-sliced the GPU). ``voicebot asr-serve`` (:mod:`voicebot.asr_service`) hosts that
engine; this module is what a frontend runs instead of a local one.

The split: everything per call stays here. :class:`RemoteAsrEngine` *is* an
:class:`~voicebot.engines.asr.AsrEngine` with the same :class:`~voicebot.engines.asr_stream.AsrStream`
(partials every ``partial_interval_ms``, LocalAgreement, the forced prefix, reuse of the
partial that saw the end of speech, the bounded finals-first queue). Only a decode --
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
from voicebot.engines.asr.engine import AsrEngine, DecodeAbandoned, unless_abandoned
from voicebot.engines.asr.jobs import DecodeJob, Priority
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


class RemoteAsrEngine(AsrEngine):
    """:class:`AsrEngine` whose decodes run on the shared ASR service (module docstring)."""

    def __init__(
        self,
        cfg: AsrConfig,
        model_path: str = "",
        *,
        agreement_n: int = 3,
        client: AsrServiceClient | None = None,
    ) -> None:
        super().__init__(cfg, model_path or cfg.remote.url, agreement_n=agreement_n)
        self.client = client or AsrServiceClient(cfg.remote)
        self.in_flight = 0  # decodes sent to the service and not answered
        self._running: dict[DecodeJob, asyncio.Task[tuple[str, float]]] = {}
        self._last_partial_warning = -1e9  # monotonic time of the last failed-partial log line

    async def start(self) -> None:
        rcfg = self.cfg.remote
        took = await connect_at_start(self.client, rcfg.startup_timeout_s)
        # One task per decode slot, as for vLLM: each takes the next job (finals first)
        # and awaits the service. The service bounds its own queue; this count bounds ours.
        self._workers = [
            asyncio.create_task(self._worker(), name=f"asr-remote-{i}") for i in range(rcfg.concurrency)
        ]
        log.info(
            "ASR: the shared service at %s (%s, %s) in %.1f s, %d decode slots",
            rcfg.url,
            (self.client.hello or {}).get("backend"),
            (self.client.hello or {}).get("model"),
            took,
            rcfg.concurrency,
        )

    async def aclose(self) -> None:
        try:
            await super().aclose()  # cancels the workers: their decodes are cancelled at the service
        finally:
            await self.client.aclose()

    def _abandon(self, job: DecodeJob) -> None:
        """Stop a superseded partial at the service (AsrStream calls this on finalize,
        reset and close): its decode is cancelled there."""
        super()._abandon(job)
        task = self._running.get(job)
        if task is not None:
            task.cancel()

    async def _decode_remote(self, job: DecodeJob) -> tuple[str, float]:
        assert job.audio is not None
        self.in_flight += 1
        try:
            return await self.client.decode(job.audio, job.prefix, job.language, job.priority)
        finally:
            self.in_flight -= 1

    async def _run_decode(self, job: DecodeJob) -> tuple[str, float]:
        decode = asyncio.ensure_future(self._decode_remote(job))
        self._running[job] = decode
        try:
            if job.future is None:
                return await self._partial(job, decode)
            return await self._final(job, decode)
        finally:
            self._running.pop(job, None)

    async def _partial(self, job: DecodeJob, decode: asyncio.Future[tuple[str, float]]) -> tuple[str, float]:
        assert job.owner is not None
        try:
            return await decode
        except PartialDropped:
            self.stats.dropped_partials += 1
            job.owner._partial_dropped(job)  # retried on the stream's next audio
            raise DecodeAbandoned from None
        except EngineError as exc:
            # Counted as the base worker would (the supervisor's failure streak), but with
            # the service down every caller's partials fail: one log line per 10 s, not a
            # traceback per decode. A final's failure still goes to its waiter.
            self.stats.failed_decodes += 1
            now = time.monotonic()
            if now - self._last_partial_warning >= 10.0:
                self._last_partial_warning = now
                log.warning("ASR partial decodes failing: %s", exc)
            job.owner._partial_done(job, None)
            raise DecodeAbandoned from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the engine is closing
            self._partial_abandoned(job)  # superseded (_abandon): nothing to report
            raise DecodeAbandoned from None

    async def _final(self, job: DecodeJob, decode: asyncio.Future[tuple[str, float]]) -> tuple[str, float]:
        assert job.future is not None
        try:
            return await unless_abandoned(decode, job.future)
        except PartialDropped:  # the service never drops finals; be safe all the same
            raise EngineError("ASR service dropped a final decode", code="asr_unavailable") from None
