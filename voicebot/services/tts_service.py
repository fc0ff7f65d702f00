"""``voicebot tts-serve``: ONE TTS engine shared by many frontends (``tts.backend: remote``).

On one GPU, K frontends with a Kokoro engine each are K CUDA contexts time-slicing the GPU
with the LLM server and the ASR service, and each Kokoro's host work (thousands of kernel
launches per forward) shares its frontend's GIL with the event loop (docs/gpu-results.md,
'One TTS service'). This process hosts the single engine the config's tts section describes -- Kokoro
on the GPU, whose batcher puts every frontend's clauses into one forward, or Piper on this
host's cores -- as ``voicebot asr-serve`` hosts the one Whisper.

It keeps no per-call state: a frontend sends a clause (text, voice, speed) and gets its
sentences' audio back as they are synthesised (:mod:`voicebot.services.tts_client` has the wire
format). Each clause is one task iterating the engine's ``synthesize``, so the engine's own
queue, batching and deadlines apply unchanged; the task sends at most ``window`` chunks the
frontend has not acknowledged, then waits (the engine holds one sentence of look-ahead beyond
that, as in-process). A ``cancel`` or a closed connection cancels the clause's task, which
closes the engine's stream: a queued sentence is dropped, a running one aborted or discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets
from websockets.asyncio.server import ServerConnection, serve

from voicebot.config import Config
from voicebot.engines.contracts import BatchedTts, Tts
from voicebot.errors import EngineError, VoicebotError
from voicebot.runtime.recent import RecentTimes
from voicebot.services.serve import listen as listen_ws
from voicebot.services.serve import run_service, serve_until_stopped
from voicebot.services.tts_client import MAX_FRAME, PROTOCOL
from voicebot.services.wire import ServiceConn, is_id, pack_frame

__all__ = ["ServiceStats", "TtsService", "listen", "run_tts_service", "serve_tts"]

log = logging.getLogger(__name__)

# Clauses one connection may have in synthesis; a frontend bounds itself below
# (tts.remote.concurrency), so this only stops a runaway client.
MAX_JOBS_PER_CONNECTION = 4096
MAX_TEXT_CHARS = 20_000  # a clause is a sentence or a few; an LLM reply is capped far below
MAX_WINDOW = 64  # tts.remote.window's bound
# A clause whose frontend takes none of its sent chunks for this long is dropped: a session
# takes its next chunk within one sentence's playback, so only a lost cancel gets here.
ACK_TIMEOUT_S = 300.0
FRAME_HEADER_BYTES = 256  # room for an audio frame's length and JSON header within MAX_FRAME


def frames_of(chunk: np.ndarray) -> list[np.ndarray]:
    """A sentence's audio cut into pieces whose frames fit the client's MAX_FRAME (a sentence
    over ~95 s at 22.05 kHz would otherwise close the connection, 1009, with every clause on it)."""
    per_frame = (MAX_FRAME - FRAME_HEADER_BYTES) // 4
    return [chunk[i : i + per_frame] for i in range(0, len(chunk), per_frame)] or [chunk]


@dataclass
class ServiceStats:
    connections: int = 0
    open_connections: int = 0
    clauses: int = 0  # synthesised to their end
    chunks: int = 0  # audio frames sent (a sentence, or a piece of one longer than a frame)
    cancelled: int = 0  # by their frontend, or by their connection closing
    failed: int = 0
    bad_requests: int = 0
    busy: int = 0
    late: int = 0  # later clauses whose first audio came after their caller needed it (ClauseTimes)

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


# Clauses whose times ``stats`` reports: the last few hundred, so a burst's show while it lasts.
RECENT_CLAUSES = 512


class ClauseTimes:
    """How soon each clause's first audio came, against when its caller needs it.

    A reply's first clause (``ahead_s`` 0) is waited for in silence: its time from request
    to first audio here is the service's share of the caller's wait. A later clause is
    needed once the audio ahead of it has played, ``ahead_s`` after its request (the
    frontend's estimate): first audio after that is a gap the caller hears, unless the
    frontend's playout lead covers it. Where a burst's replies stall, these say whether
    the clauses came late from here."""

    def __init__(self, size: int = RECENT_CLAUSES) -> None:
        self._first = RecentTimes(size)  # first clauses: request to first audio
        self._late = RecentTimes(size)  # later clauses: first audio past the need (0: in time)

    def add(self, waited_s: float, ahead_s: float) -> bool:
        """One clause's first audio ``waited_s`` after its request; True if it came late."""
        if ahead_s <= 0.0:
            self._first.add(waited_s)
            return False
        late = max(0.0, waited_s - ahead_s)
        self._late.add(late)
        return late > 0.0

    def as_json(self) -> dict[str, float]:
        return {**self._first.stats("first_audio"), **self._late.stats("late")}


@dataclass(eq=False)
class _Job:
    id: int
    window: int
    unacked: int = 0  # chunks sent and not yet taken by the frontend's session
    room: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


_Conn = ServiceConn[_Job]


class _Request(ValueError):
    """A synthesize message that cannot be served (an ``invalid_request`` error)."""


@dataclass(frozen=True)
class Synthesize:
    """A well-formed synthesize message."""

    id: int
    text: str
    voice: str | None
    speed: float | None
    window: int
    ahead_s: float  # the reply's audio heard before this clause's (the engine's queue order)


MAX_AHEAD_S = 3600.0


def parse_synthesize(data: dict[str, Any]) -> Synthesize:
    """A synthesize message's fields; _Request when malformed."""
    job_id, text, voice, speed, window, ahead = (
        data.get(k) for k in ("id", "text", "voice", "speed", "window", "ahead_s"))
    if not is_id(job_id):
        raise _Request("synthesize id must be an integer")
    if not isinstance(text, str) or len(text) > MAX_TEXT_CHARS:
        raise _Request(f"synthesize text must be a string of at most {MAX_TEXT_CHARS} characters")
    if voice is not None and not isinstance(voice, str):
        raise _Request("synthesize voice must be a string or null")
    if speed is not None and (isinstance(speed, bool) or not isinstance(speed, int | float) or not speed > 0):
        raise _Request("synthesize speed must be a positive number or null")
    window = 1 if window is None else window
    if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= MAX_WINDOW:
        raise _Request(f"synthesize window must be an integer from 1 to {MAX_WINDOW}")
    ahead = 0.0 if ahead is None else ahead  # an older frontend sends none
    if isinstance(ahead, bool) or not isinstance(ahead, int | float) or not 0.0 <= ahead <= MAX_AHEAD_S:
        raise _Request(f"synthesize ahead_s must be a number from 0 to {MAX_AHEAD_S:g}")
    return Synthesize(job_id, text, voice, None if speed is None else float(speed), window, float(ahead))


class TtsService:
    """The clause tasks and the WebSocket handler around one started engine."""

    def __init__(self, engine: Tts, *, engine_name: str = "") -> None:
        self.engine = engine
        self.engine_name = engine_name
        self.stats = ServiceStats()
        self.times = ClauseTimes()
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[_Conn] = set()  # open connections (bounded by the listener's)
        self._closed = False

    @property
    def running(self) -> int:
        """Clauses in synthesis now (queued in the engine, running, or waiting for their acks)."""
        return len(self._tasks)

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- one connection ---------------------------------------------------------------

    async def handler(self, ws: ServerConnection) -> None:
        conn = _Conn(ws)
        self._conns.add(conn)
        self.stats.connections += 1
        self.stats.open_connections += 1
        try:
            await ws.send(json.dumps({
                "type": "hello",
                "service": "tts",
                "protocol": PROTOCOL,
                "engine": self.engine_name,
                "sample_rate": self.engine.sample_rate,
                "voices": self.engine.voices(),
            }))
            async for msg in ws:
                await self._on_message(conn, msg)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.stats.open_connections -= 1
            self._conns.discard(conn)
            conn.closed = True
            for job in list(conn.jobs.values()):
                if job.task is not None and job.task.cancel():
                    self.stats.cancelled += 1  # nobody is left to hear it
            conn.jobs.clear()

    async def _on_message(self, conn: _Conn, msg: str | bytes) -> None:
        data: Any = None
        if isinstance(msg, str):
            with contextlib.suppress(json.JSONDecodeError):
                data = json.loads(msg)
        kind = data.get("type") if isinstance(data, dict) else None
        if kind in ("ack", "cancel") and not is_id(data.get("id")):
            self.stats.bad_requests += 1  # a list or dict id would not even hash
            await self._error(conn, None, "invalid_request", f"{kind} id must be an integer")
        elif kind == "ack":
            job = conn.jobs.get(data.get("id"))
            if job is not None and job.unacked > 0:
                job.unacked -= 1
                job.room.set()
        elif kind == "synthesize":
            await self._on_synthesize(conn, data)
        elif kind == "cancel":
            job = conn.jobs.pop(data.get("id"), None)
            if job is not None and job.task is not None and job.task.cancel():
                self.stats.cancelled += 1  # finished meanwhile otherwise: its end is ignored
        elif kind == "stats":
            await self._send(conn, {"type": "stats", **self.snapshot()})
        else:
            self.stats.bad_requests += 1
            await self._error(conn, None, "invalid_event", "unknown message")

    async def _on_synthesize(self, conn: _Conn, data: dict[str, Any]) -> None:
        try:
            req = parse_synthesize(data)
        except _Request as exc:
            self.stats.bad_requests += 1
            await self._error(conn, data.get("id") if is_id(data.get("id")) else None, "invalid_request", str(exc))
            return
        if req.id in conn.jobs:
            self.stats.bad_requests += 1
            await self._error(conn, req.id, "invalid_request", "duplicate id")
            return
        if self._closed or len(conn.jobs) >= MAX_JOBS_PER_CONNECTION:
            self.stats.busy += 1
            await self._error(conn, req.id, "busy", "too many clauses in synthesis")
            return
        job = conn.jobs[req.id] = _Job(req.id, req.window)
        job.task = asyncio.create_task(self._synthesize(conn, job, req), name=f"tts-clause-{req.id}")
        self._tasks.add(job.task)
        job.task.add_done_callback(self._tasks.discard)

    async def _synthesize(self, conn: _Conn, job: _Job, req: Synthesize) -> None:
        asked = time.monotonic()
        first = True
        try:
            async with contextlib.aclosing(
                self.engine.synthesize(req.text, voice=req.voice, speed=req.speed, ahead_s=req.ahead_s)
            ) as chunks:
                async for chunk in chunks:
                    if first:
                        first = False
                        if self.times.add(time.monotonic() - asked, req.ahead_s):
                            self.stats.late += 1
                    for piece in frames_of(chunk):  # each piece is a chunk to the frontend
                        while job.unacked >= job.window:
                            job.room.clear()
                            try:
                                async with asyncio.timeout(ACK_TIMEOUT_S):
                                    await job.room.wait()
                            except TimeoutError:
                                raise EngineError(
                                    f"the frontend took no audio of this clause in {ACK_TIMEOUT_S:g} s",
                                    code="tts_timeout",
                                ) from None
                        job.unacked += 1
                        await conn.ws.send(pack_frame({"type": "audio", "id": job.id}, piece))
                        self.stats.chunks += 1
        except websockets.ConnectionClosed:
            return  # the handler cancels the connection's other clauses
        except Exception as exc:
            self.stats.failed += 1
            if not isinstance(exc, VoicebotError):
                log.warning("TTS synthesis failed: %s", exc, exc_info=True)
            code = exc.code if isinstance(exc, VoicebotError) else "engine_error"
            if conn.jobs.pop(job.id, None) is job:
                await self._error(conn, job.id, code, str(exc))
            return
        if conn.jobs.pop(job.id, None) is job:
            self.stats.clauses += 1
            await self._send(conn, {"type": "done", "id": job.id})

    async def _error(self, conn: _Conn, job_id: int | None, code: str, message: str) -> None:
        await self._send(conn, {"type": "error", "id": job_id, "code": code, "message": message})

    async def _send(self, conn: _Conn, payload: dict[str, Any]) -> None:
        if conn.closed:
            return
        with contextlib.suppress(websockets.ConnectionClosed):
            await conn.ws.send(json.dumps(payload))

    def snapshot(self) -> dict[str, Any]:
        forwards = self.engine.forward_stats() if isinstance(self.engine, BatchedTts) else {}
        return {**self.stats.as_json(), **self.times.as_json(), **forwards, "running": self.running,
                "engine_queue_depth": self.engine.queue_depth, "engine_failure_streak": self.engine.failure_streak}


# -- the process ------------------------------------------------------------------------


def listen(service: TtsService, host: str, port: int) -> serve:
    """The WebSocket server of ``service`` (use as ``async with``)."""
    return listen_ws(service.handler, host, port, max_size=MAX_FRAME)


async def serve_tts(
    cfg: Config,
    host: str,
    port: int,
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    pull: bool = True,
) -> None:
    """Load the engine, serve until ``stop`` (or SIGINT/SIGTERM), close everything."""
    from voicebot.engines.registry import create_tts
    from voicebot.provision import resolve_model
    from voicebot.provision.resolve import tts_model_ref

    tcfg = cfg.tts.model_copy(update={"backend": "local"})
    if cfg.models.offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    voice_path = None
    if (ref := tts_model_ref(tcfg)) is not None:
        voice_path = await asyncio.to_thread(resolve_model, ref, cfg.models, pull=pull)
    t0 = time.perf_counter()
    engine = create_tts(tcfg, voice_path)
    await engine.start()
    service = TtsService(engine, engine_name=tcfg.engine)

    def on_ready(url: str) -> None:
        log.info("TTS service (%s, %d Hz) ready on %s in %.1f s", tcfg.engine, engine.sample_rate, url,
                 time.perf_counter() - t0)
        if ready is not None:
            ready(url)

    await serve_until_stopped(listen(service, host, port), stop or asyncio.Event(), on_ready,
                              close=(service.aclose, engine.aclose), loop_stall_s=cfg.server.loop_stall_s)


def run_tts_service(cfg: Config, host: str, port: int, *, pull: bool = True) -> int:
    """``voicebot tts-serve``: prints one JSON line ``{"tts_service": URL}`` once it listens."""
    return run_service("tts", cfg.server, lambda ready: serve_tts(cfg, host, port, ready=ready, pull=pull))
