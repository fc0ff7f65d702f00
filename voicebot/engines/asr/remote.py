"""The frontend half of the shared ASR service (``asr.backend: remote``).

One GPU serves more callers when ONE Whisper engine batches every frontend's streams
(frontends with an engine each time-slice the GPU: docs/gpu-results.md, 'Why the GPU
configs are what they are'). ``voicebot asr-serve`` (:mod:`voicebot.services.asr_service`) hosts that
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

The wire format and the client are in :mod:`voicebot.services.asr_client`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from voicebot.config import AsrConfig, RemoteAsrConfig
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.asr.jobs import (
    DecodeAbandoned,
    DecodeDropped,
    DecodeFailed,
    DecodeJob,
    unless_abandoned,
)
from voicebot.errors import EngineError, LateLoopTimeout
from voicebot.runtime.loop_lag import LoopLateness
from voicebot.services.asr_client import AsrServiceClient, PartialDropped
from voicebot.services.wire import (
    connect_at_start,
)

__all__ = ["RemoteAsrEngine", "RemoteDecoder"]

log = logging.getLogger(__name__)

class RemoteDecoder:
    """A :class:`~voicebot.engines.asr.jobs.Decoder`: each decode goes to the shared ASR
    service over one multiplexed connection (:class:`AsrServiceClient`)."""

    name = "asr-remote"
    # The service's engine re-decodes its own loops; a temperature is not sent.
    samples = False

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
        except LateLoopTimeout:
            raise DecodeAbandoned from None  # our late loop's, not the service's: not counted
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
        loop: LoopLateness | None = None,
    ) -> None:
        """``loop``: the server's loop watch (a decode timed out by our own late loop is not
        counted against the service's health)."""
        self._remote = RemoteDecoder(cfg.remote, client or AsrServiceClient(cfg.remote, loop=loop))
        super().__init__(cfg, model_path or cfg.remote.url, agreement_n=agreement_n, decoder=self._remote)

    @property
    def client(self) -> AsrServiceClient:
        return self._remote.client

    @property
    def in_flight(self) -> int:
        """Decodes sent to the service and not answered."""
        return self._remote.in_flight
