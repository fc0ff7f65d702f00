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

Several services (``tts.remote.urls`` beside ``url``): each clause goes to the one with the
fewest of this frontend's clauses in flight (ties in turn). A clause whose service cannot be
reached, or is full, before its first audio goes to the next one at once, and a service that
could not be reached gets no new clause for ``down_s`` while another is up; ``retries`` are
then rounds over every service. One Kokoro process caps the speech a second of every frontend
behind it, wherever it runs (docs/gpu-results.md): more processes are the way past it.

Failures: a connection lost before a clause's first audio is retried (``tts.remote.retries``)
on a new connection; once audio came, the clause fails with ``EngineError(code="tts_unavailable")``
and the session reports it (an error event; the reply ends ``failed``). No next chunk within
``chunk_timeout_s`` fails with ``tts_timeout``. Health is the local engines' rule: syntheses
failed in a row (``failure_streak``), which the supervisor turns into ``/healthz`` 503; a
timeout after the frontend's own loop ran late for most of the wait is not counted
(:class:`~voicebot.errors.LateLoopTimeout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator

import numpy as np

from voicebot.config import TtsConfig
from voicebot.engines.tts.text import clean_text
from voicebot.errors import CapacityError, ConfigError, EngineError, LateLoopTimeout
from voicebot.runtime.loop_lag import LoopLateness
from voicebot.services.tts_client import TtsServiceClient
from voicebot.services.wire import ServiceUnreachable, connect_at_start

__all__ = ["RemoteTts"]

log = logging.getLogger(__name__)


class RemoteTts:
    """The :class:`~voicebot.engines.contracts.Tts` contract, its syntheses run on the shared TTS service."""

    def __init__(self, cfg: TtsConfig, *, client: TtsServiceClient | None = None,
                 loop: LoopLateness | None = None) -> None:
        self._cfg = cfg
        rcfg = cfg.remote
        if client is not None:
            self.clients = [client]
        else:
            # Several services: a clause lost before its first audio goes to another at once,
            # so a client does not retry its own service; the retries are rounds over them all.
            one = {} if len(rcfg.services) == 1 else {"retries": 0}
            self.clients = [TtsServiceClient(rcfg.model_copy(update={"url": url, **one}), loop=loop)
                            for url in rcfg.services]
        self.client = self.clients[0]
        self._in_flight = dict.fromkeys(self.clients, 0)  # this frontend's clauses at each service
        self._down_until = dict.fromkeys(self.clients, 0.0)  # loop time a lost service is left out until
        self._turn = itertools.count()  # ties between services: in turn
        # Until start() learns the service's rate: what the engines of this config would say.
        self.sample_rate = 24_000 if cfg.engine == "kokoro" else 22_050
        self._failure_streak = 0
        self._last_error: BaseException | None = None
        self._waiting = 0  # clauses sent and waiting for their first audio
        self._active = 0  # synthesize calls under way: connecting, backing off, sent or streaming
        self.completed = 0
        self.failed = 0

    async def start(self) -> None:
        """Connect to every service, each waited for up to ``startup_timeout_s``. With several,
        one that never answered is left out (for ``down_s``, then tried again by the next
        clause, and taken once it answers at the others' rate): a frontend restarted while one
        TTS service is down starts on the others. One that answers as another service, or
        services that disagree on their rate, are configuration errors: no start."""
        rcfg = self._cfg.remote

        async def connect(client: TtsServiceClient) -> float | ServiceUnreachable:
            try:
                return await connect_at_start(client, rcfg.startup_timeout_s)
            except ServiceUnreachable as exc:
                return exc  # anything else ends the start at once, the other waits with it

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(connect(c)) for c in self.clients]
            took = [t.result() for t in tasks]
            up = [c for c, result in zip(self.clients, took, strict=True) if isinstance(result, float)]
            if not up:
                raise next(r for r in took if isinstance(r, ServiceUnreachable))
            rates = {c.cfg.url: int((c.hello or {})["sample_rate"]) for c in up}  # checked by each client
            if len(set(rates.values())) > 1:
                raise ConfigError(f"tts.remote: the TTS services synthesise at different sample rates: {rates}")
        except BaseException as exc:
            await self.aclose()  # a failed start leaves no connection open
            if isinstance(exc, BaseExceptionGroup):
                raise exc.exceptions[0] from None  # the first service's own error, not a group
            raise
        self.client = up[0]
        self.sample_rate = rates[self.client.cfg.url]
        now = asyncio.get_running_loop().time()
        for client, result in zip(self.clients, took, strict=True):
            client.expect_rate = self.sample_rate
            if isinstance(result, ServiceUnreachable):
                self._down_until[client] = now + rcfg.down_s
                log.warning("%s; its clauses go to the others until it answers", result)
        hello = self.client.hello or {}
        log.info("TTS: the shared service%s at %s (%s, %d Hz) in %.1f s", "s" if len(up) > 1 else "",
                 ", ".join(rates), hello.get("engine"), self.sample_rate,
                 max(t for t in took if isinstance(t, float)))

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    def services_down(self) -> list[str]:
        """The services left out of new clauses now (their connection failed lately)."""
        now = asyncio.get_running_loop().time()
        return [c.cfg.url for c in self.clients if self._down_until[c] > now]

    def _order(self) -> list[TtsServiceClient]:
        """This clause's services to try, best first: those up, by this frontend's clauses in
        flight at each (ties in turn); all of them when none is up (one may be back)."""
        now = asyncio.get_running_loop().time()
        up = [c for c in self.clients if self._down_until[c] <= now] or list(self.clients)
        turn = next(self._turn)
        n = len(self.clients)
        return sorted(up, key=lambda c: (self._in_flight[c], (self.clients.index(c) - turn) % n))

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
            async with contextlib.aclosing(self._stream(text, voice, speed, ahead_s)) as chunks:
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

    async def _stream(self, text: str, voice: str | None, speed: float | None,
                      ahead_s: float) -> AsyncGenerator[np.ndarray, None]:
        """One clause from the services, best first; to the next one while no audio came."""
        if len(self.clients) == 1:  # its client retries its own service
            async with contextlib.aclosing(self.client.stream(text, voice, speed, ahead_s)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        rcfg = self._cfg.remote
        loop = asyncio.get_running_loop()
        for attempt in itertools.count():
            lost: EngineError | None = None
            busy: CapacityError | None = None
            for client in self._order():
                got_audio = False
                self._in_flight[client] += 1
                try:
                    async with contextlib.aclosing(client.stream(text, voice, speed, ahead_s)) as chunks:
                        async for chunk in chunks:
                            got_audio = True
                            yield chunk
                    self._down_until[client] = 0.0
                    return
                except CapacityError as exc:  # that service's queue is full: the next one may not be
                    if got_audio:
                        raise
                    busy = exc
                except EngineError as exc:
                    if got_audio or exc.code != "tts_unavailable" or isinstance(exc, LateLoopTimeout):
                        raise  # audio came (never asked for twice), or not the service's absence
                    self._down_until[client] = loop.time() + rcfg.down_s
                    log.warning("TTS service %s: %s; its clauses go to the others for %g s",
                                client.cfg.url, exc, rcfg.down_s)
                    lost = exc
                finally:
                    self._in_flight[client] -= 1
            if lost is None or attempt >= rcfg.retries:  # every one full: as one full service is, at once
                failed = lost or busy
                assert failed is not None
                raise failed
            await asyncio.sleep(rcfg.retry_backoff_s * 2**attempt)
