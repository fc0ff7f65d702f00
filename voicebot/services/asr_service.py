"""``voicebot asr-serve``: ONE ASR engine shared by many frontends (``asr.backend: remote``).

On one GPU, K frontends with a Whisper engine each time-slice the GPU and are slower
than one (docs/gpu-results.md, 'Why the GPU configs are what they are'). This process hosts the single
engine -- faster-whisper on a CPU, Whisper on vLLM on a GPU (``asr.backend``, or
``asr.remote.engine`` when the config says ``remote``) -- and every frontend's decodes
share it, as the LLM tier shares one vLLM server.

It keeps no per-call state: frontends run the streams (partials, agreement, the forced
prefix) and send decodes (:mod:`voicebot.services.asr_client` has the wire format).
Here they meet in one bounded finals-first queue (:class:`~voicebot.engines.asr.jobs.JobQueue`,
the same policy as in-process: a final evicts the newest queued partial when full; a
partial finding it full is answered ``dropped``) in front of the engine's decode slots
(``asr.workers`` threads for faster-whisper, ``WhisperVllmSettings.concurrency`` requests
in flight for vLLM). A ``cancel`` or a closed connection takes queued jobs out and cancels
running ones (vLLM aborts the request; a faster-whisper thread stops at its next checkpoint,
before the encoder or the decoder, and the rest is ignored).

A streaming engine (``asr.remote.engine: fastconformer``) is served differently: it keeps
each call's encoder state, so the service holds the streams themselves and frontends send
audio as it comes (:mod:`voicebot.services.asr_stream_service`, protocol 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import websockets
from websockets.asyncio.server import ServerConnection, serve

from voicebot.config import Config
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.asr.jobs import DecodeAbandoned, DecodeJob, JobQueue, Priority
from voicebot.errors import VoicebotError
from voicebot.services.asr_client import MAX_FRAME, PROTOCOL, unpack_decode
from voicebot.services.asr_stream_client import MAX_FRAME as MAX_STREAM_FRAME
from voicebot.services.serve import listen as listen_ws
from voicebot.services.serve import run_service, serve_until_stopped
from voicebot.services.wire import ServiceConn, is_id

if TYPE_CHECKING:
    from voicebot.services.asr_stream_service import StreamService

__all__ = ["AsrService", "ServiceStats", "listen", "run_asr_service", "serve_asr"]

log = logging.getLogger(__name__)

# Jobs one connection may have queued or running; a frontend bounds itself well below
# (asr.remote.concurrency), so this only stops a runaway client.
MAX_JOBS_PER_CONNECTION = 4096


@dataclass
class ServiceStats:
    connections: int = 0
    open_connections: int = 0
    finals: int = 0
    partials: int = 0
    dropped_partials: int = 0
    cancelled: int = 0
    failed: int = 0
    bad_requests: int = 0
    busy: int = 0

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class _Job:
    priority: Priority
    owner: _Conn
    id: int
    decode: DecodeJob
    task: asyncio.Future[tuple[str, float]] | None = None


_Conn = ServiceConn[_Job]


class AsrService:
    """The queue, the decode slots and the WebSocket handler around one started engine."""

    def __init__(self, engine: AsrEngine, *, slots: int, queue_size: int, backend: str = "") -> None:
        self.engine = engine
        self.slots = slots
        self.backend = backend
        self.stats = ServiceStats()
        self._queue: JobQueue[_Job] = JobQueue(queue_size)
        self._work = asyncio.Event()
        self._space = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._closed = False
        self.running = 0  # decodes in the engine now

    @property
    def queue_depth(self) -> int:
        return len(self._queue)


    def start(self) -> None:
        self._workers = [asyncio.create_task(self._worker(), name=f"asr-slot-{i}") for i in range(self.slots)]

    async def aclose(self) -> None:
        self._closed = True
        self._space.set()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        while self._queue.pop() is not None:
            pass

    # -- one connection ---------------------------------------------------------------

    async def handler(self, ws: ServerConnection) -> None:
        conn = _Conn(ws)
        self.stats.connections += 1
        self.stats.open_connections += 1
        try:
            await ws.send(
                json.dumps(
                    {
                        "type": "hello",
                        "service": "asr",
                        "protocol": PROTOCOL,
                        "backend": self.backend,
                        "model": self.engine.model_path,
                        "slots": self.slots,
                    }
                )
            )
            async for msg in ws:
                if isinstance(msg, str):
                    await self._on_text(conn, msg)
                else:
                    await self._on_decode(conn, msg)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.stats.open_connections -= 1
            conn.closed = True
            self._queue.remove_owner(conn)
            for job in list(conn.jobs.values()):
                if job.task is not None:
                    job.decode.stale = True  # a decode thread stops at its next checkpoint
                    job.task.cancel()  # nobody is left to read the result
            conn.jobs.clear()
            self._space.set()

    async def _on_text(self, conn: _Conn, msg: str) -> None:
        try:
            data = json.loads(msg)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and data.get("type") == "cancel" and is_id(data.get("id")):
            job = conn.jobs.pop(data["id"], None)
            if job is None:
                return  # finished meanwhile: its result is on the way and will be ignored
            self.stats.cancelled += 1
            if job.task is not None:
                job.decode.stale = True  # a decode thread stops at its next checkpoint
                job.task.cancel()
            elif self._queue.remove(job):
                self._space.set()
            return
        if isinstance(data, dict) and data.get("type") == "stats":
            await self._send(conn, {"type": "stats", **self.snapshot()})
            return
        self.stats.bad_requests += 1
        await self._send(conn, {"type": "error", "id": None, "code": "invalid_event", "message": "unknown message"})

    async def _on_decode(self, conn: _Conn, frame: bytes) -> None:
        try:
            header, audio = unpack_decode(frame)
        except ValueError as exc:
            self.stats.bad_requests += 1
            await self._send(conn, {"type": "error", "id": None, "code": "invalid_request", "message": str(exc)})
            return
        job_id: int = header["id"]
        if job_id in conn.jobs:
            self.stats.bad_requests += 1
            await self._send(conn, {"type": "error", "id": job_id, "code": "invalid_request", "message": "duplicate id"})
            return
        if len(conn.jobs) >= MAX_JOBS_PER_CONNECTION:
            self.stats.busy += 1
            await self._send(conn, {"type": "error", "id": job_id, "code": "busy", "message": "too many decodes in flight"})
            return
        priority = Priority(header["priority"])
        decode = DecodeJob(priority, None, audio=audio, prefix=header.get("prefix", ""), language=header.get("language"))
        job = _Job(priority, conn, job_id, decode)
        if priority is Priority.PARTIAL:
            if self._closed or not self._queue.offer_partial(job):
                self.stats.dropped_partials += 1
                await self._send(conn, {"type": "error", "id": job_id, "code": "dropped", "message": "queue full"})
                return
            conn.jobs[job_id] = job
        else:
            conn.jobs[job_id] = job
            # A queue full of finals makes this connection wait (its reader too): backpressure.
            while not self._closed and not self._queue.can_take_final():
                self._space.clear()
                await self._space.wait()
            if self._closed:
                conn.jobs.pop(job_id, None)
                await self._send(conn, {"type": "error", "id": job_id, "code": "asr_unavailable", "message": "ASR service closing"})
                return
            if conn.closed or job_id not in conn.jobs:
                return
            evicted = self._queue.put_final(job)
            if evicted is not None:
                self.stats.dropped_partials += 1
                evicted.owner.jobs.pop(evicted.id, None)
                await self._send(evicted.owner, {"type": "error", "id": evicted.id, "code": "dropped", "message": "queue full"})
        self._work.set()

    async def _send(self, conn: _Conn, payload: dict[str, Any]) -> None:
        if conn.closed:
            return
        with contextlib.suppress(websockets.ConnectionClosed):
            await conn.ws.send(json.dumps(payload))

    # -- decode slots -----------------------------------------------------------------

    async def _worker(self) -> None:
        me = asyncio.current_task()
        while True:
            job = self._queue.pop()
            if job is None:
                self._work.clear()
                await self._work.wait()
                continue
            self._space.set()
            conn = job.owner
            if conn.closed or conn.jobs.get(job.id) is not job:
                continue
            # The engine's decoder (faster-whisper: its thread pool; vLLM: a request
            # aborted when cancelled), without the engine's queue: the queue is this one.
            job.task = asyncio.ensure_future(self.engine.decoder.decode(job.decode))
            self.running += 1
            try:
                text, decode_s = await job.task
            except asyncio.CancelledError:
                if me is not None and me.cancelling():
                    job.task.cancel()
                    raise  # the service is closing
                continue  # cancelled by its frontend, or its connection closed
            except DecodeAbandoned:
                continue
            except Exception as exc:
                self.stats.failed += 1
                log.warning("ASR decode failed: %s", exc, exc_info=True)
                code = exc.code if isinstance(exc, VoicebotError) else "engine_error"
                if conn.jobs.pop(job.id, None) is job:
                    await self._send(conn, {"type": "error", "id": job.id, "code": code, "message": str(exc)})
                continue
            finally:
                self.running -= 1
            if conn.jobs.pop(job.id, None) is not job:
                continue  # cancelled just as it finished
            if job.priority is Priority.FINAL:
                self.stats.finals += 1
            else:
                self.stats.partials += 1
            await self._send(conn, {"type": "result", "id": job.id, "text": text, "decode_s": round(decode_s, 6)})

    def snapshot(self) -> dict[str, Any]:
        return {**self.stats.as_json(), "queue_depth": self.queue_depth, "running": self.running, "slots": self.slots}


# -- the process ------------------------------------------------------------------------


def listen(service: AsrService, host: str, port: int) -> serve:
    """The WebSocket server of ``service`` (use as ``async with``)."""
    return listen_ws(service.handler, host, port, max_size=MAX_FRAME)


async def serve_asr(
    cfg: Config,
    host: str,
    port: int,
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    pull: bool = True,
) -> None:
    """Load the engine, serve until ``stop`` (or SIGINT/SIGTERM), close everything."""
    from voicebot.engines.registry import create_asr
    from voicebot.provision import resolve_model
    from voicebot.provision.resolve import asr_model_ref

    backend = cfg.asr.remote.engine if cfg.asr.backend == "remote" else cfg.asr.backend
    acfg = cfg.asr.model_copy(update={"backend": backend})
    if cfg.models.offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = await asyncio.to_thread(resolve_model, asr_model_ref(acfg), cfg.models, pull=pull)
    t0 = time.perf_counter()
    engine = create_asr(acfg, path)
    await engine.start()
    handler: AsrService | StreamService
    if isinstance(engine, AsrEngine):
        slots = engine.decoder.slots
        handler = AsrService(engine, slots=slots, queue_size=acfg.queue_size, backend=backend)
        handler.start()
        what = f"{slots} decode slots"
    else:
        # A streaming engine keeps each call's encoder state: the service holds the streams.
        from voicebot.engines.asr.fastconformer import FastConformerAsr
        from voicebot.services.asr_stream_service import StreamService

        assert isinstance(engine, FastConformerAsr)  # a service never builds the remote clients
        handler = StreamService(engine, backend=backend)
        what = f"{engine.fc.max_streams} stream slots, {engine.chunk_ms} ms chunks"

    def on_ready(url: str) -> None:
        log.info("ASR service (%s, %s, %s) ready on %s in %.1f s", backend, path, what, url,
                 time.perf_counter() - t0)
        if ready is not None:
            ready(url)

    max_size = MAX_FRAME if isinstance(handler, AsrService) else MAX_STREAM_FRAME
    await serve_until_stopped(listen_ws(handler.handler, host, port, max_size=max_size), stop or asyncio.Event(),
                              on_ready, close=(handler.aclose, engine.aclose), loop_stall_s=cfg.server.loop_stall_s)


def run_asr_service(cfg: Config, host: str, port: int, *, pull: bool = True) -> int:
    """``voicebot asr-serve``: prints one JSON line ``{"asr_service": URL}`` once it listens."""
    return run_service("asr", cfg.server, lambda ready: serve_asr(cfg, host, port, ready=ready, pull=pull))
