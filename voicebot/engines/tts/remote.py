"""The frontend half of the shared TTS service (``tts.backend: remote``).

On one GPU, K frontends with a Kokoro engine each are K CUDA contexts time-slicing the GPU
with the LLM and the ASR service, and each Kokoro's host work shares its frontend's GIL with
the event loop (docs/gpu-results.md, 'One TTS service'). ``voicebot tts-serve`` (:mod:`voicebot.services.tts_service`)
hosts ONE engine -- Kokoro batching every frontend's clauses in one forward, or Piper on the
service's cores -- and this module is what a frontend runs instead of a local one.

:class:`RemoteTts` implements :class:`~voicebot.engines.contracts.Tts`: ``synthesize(clause)``
yields float32 chunks at ``sample_rate`` (the service's engine's), one per sentence (several
for a sentence longer than one frame holds), each as it arrives. Text cleaning and sentence cutting happen in the service's engine, as in-process.

The wire format, its flow control and the client are in :mod:`voicebot.services.tts_client`.

Failures: a connection lost before a clause's first audio is retried (``tts.remote.retries``)
on a new connection; once audio came, the clause fails with ``EngineError(code="tts_unavailable")``
and the session reports it (an error event; the reply ends ``failed``). No next chunk within
``chunk_timeout_s`` fails with ``tts_timeout``. Health is the local engines' rule: syntheses
failed in a row (``failure_streak``), which the supervisor turns into ``/healthz`` 503; a
timeout after the frontend's own loop ran late for most of the wait is not counted
(:class:`~voicebot.errors.LateLoopTimeout`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator

import numpy as np

from voicebot.config import TtsConfig
from voicebot.engines.tts.text import clean_text
from voicebot.errors import CapacityError, EngineError, LateLoopTimeout
from voicebot.runtime.loop_lag import LoopLateness
from voicebot.services.tts_client import TtsServiceClient
from voicebot.services.wire import connect_at_start

__all__ = ["RemoteTts"]

log = logging.getLogger(__name__)


class RemoteTts:
    """The :class:`~voicebot.engines.contracts.Tts` contract, its syntheses run on the shared TTS service."""

    def __init__(self, cfg: TtsConfig, *, client: TtsServiceClient | None = None,
                 loop: LoopLateness | None = None) -> None:
        self._cfg = cfg
        self.client = client or TtsServiceClient(cfg.remote, loop=loop)
        # Until start() learns the service's rate: what the engines of this config would say.
        self.sample_rate = 24_000 if cfg.engine == "kokoro" else 22_050
        self._failure_streak = 0
        self._last_error: BaseException | None = None
        self._waiting = 0  # clauses sent and waiting for their first audio
        self._active = 0  # synthesize calls under way: connecting, backing off, sent or streaming
        self.completed = 0
        self.failed = 0

    async def start(self) -> None:
        rcfg = self._cfg.remote
        took = await connect_at_start(self.client, rcfg.startup_timeout_s)
        hello = self.client.hello or {}
        self.sample_rate = int(hello["sample_rate"])  # checked by the client
        log.info("TTS: the shared service at %s (%s, %d Hz) in %.1f s", rcfg.url, hello.get("engine"),
                 self.sample_rate, took)

    async def aclose(self) -> None:
        await self.client.aclose()

    @property
    def queue_depth(self) -> int:
        return self._waiting

    @property
    def failure_streak(self) -> int:
        return self._failure_streak

    @property
    def last_error(self) -> BaseException | None:
        return self._last_error

    def voices(self) -> list[str]:
        names = (self.client.hello or {}).get("voices") or []
        return [str(n) for n in names]

    async def synthesize(
        self, text: str, *, voice: str | None = None, speed: float | None = None, ahead_s: float = 0.0
    ) -> AsyncGenerator[np.ndarray, None]:
        if not clean_text(text):
            return  # nothing speakable: no round trip (the engine would yield nothing)
        # Counted over the whole call: clauses waiting to connect or in a retry's backoff are
        # not registered with the client, and would escape a count of its open clauses.
        if self._active >= self._cfg.remote.concurrency:
            raise CapacityError(f"TTS service: {self._active} clauses in synthesis (tts.remote.concurrency)")
        self._active += 1
        self._waiting += 1
        first = True
        try:
            async with contextlib.aclosing(self.client.stream(text, voice, speed, ahead_s)) as chunks:
                async for chunk in chunks:
                    if first:
                        first = False
                        self._waiting -= 1
                    yield chunk
        except LateLoopTimeout as exc:  # our loop's lateness, not the service's: no streak, no reset
            self.failed += 1
            self._last_error = exc
            raise
        except EngineError as exc:  # not CapacityError: a full queue is the clause's problem, not the engine's
            self.failed += 1
            self._failure_streak += 1
            self._last_error = exc
            raise
        finally:
            self._active -= 1
            if first:
                self._waiting -= 1
        self.completed += 1
        self._failure_streak = 0
