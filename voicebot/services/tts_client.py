"""The client of the shared TTS service (``voicebot tts-serve``, :mod:`.tts_service`), and
its wire format: what a frontend's :class:`~voicebot.engines.tts.remote.RemoteTts` sends
each clause over.

Wire format (protocol 1), over one multiplexed WebSocket per frontend
(:mod:`voicebot.services.wire` has the conventions):

- service -> frontend, text, once: ``{"type": "hello", "service": "tts", "protocol", "engine", "sample_rate",
  "voices"}``;
- frontend -> service, text: ``{"type": "synthesize", "id", "text", "voice", "speed", "window", "ahead_s"}``
  (``ahead_s``, optional: seconds of the reply's audio the caller hears before this clause's:
  the engine's queue serves the clause needed soonest first);
  ``{"type": "ack", "id"}`` when the session took one chunk; ``{"type": "cancel", "id"}`` (a
  barge-in, an early close: the service stops the synthesis); ``{"type": "stats"}``;
- service -> frontend: binary audio frames (header ``{"type": "audio", "id"}``, then the
  sentence's float32 samples); text ``{"type": "done", "id"}`` after the last one, or
  ``{"type": "error", "id", "code", "message"}`` instead.

Flow control: the service sends at most ``window`` chunks of a clause that the frontend has not
acknowledged, so each clause's buffer here holds at most ``window`` chunks and its end (the
reader never waits on a session), and the service's engine runs at most one sentence beyond
that: a long reply is not synthesised far ahead of its playback (a barge-in would waste it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection

from voicebot.config import RemoteTtsConfig
from voicebot.errors import CapacityError, EngineError
from voicebot.runtime.loop_lag import LoopLateness
from voicebot.services.wire import (
    CONNECT_ERRORS,
    ServiceClient,
    ServiceLost,
    ServiceMismatch,
    samples_of,
    split_frame,
)

__all__ = ["MAX_FRAME", "PROTOCOL", "ServiceLost", "TtsServiceClient"]

log = logging.getLogger(__name__)

PROTOCOL = 1
# One sentence of audio: even a 60 s one at 24 kHz float32 is 5.8 MB; the service cuts a longer
# one into several frames (tts_service.frames_of). A clause's text is small.
MAX_FRAME = 8 * 1024 * 1024

@dataclass(eq=False)
class _Clause:
    """What the reader has received for one clause and its consumer has not taken yet."""

    id: int
    window: int
    chunks: deque[np.ndarray] = field(default_factory=deque)  # at most `window` (the service's promise)
    end: BaseException | None = None  # set once: _DONE, an EngineError or a ServiceLost
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    got_audio: bool = False


class _Done(Exception):
    """The clause's end marker (not an error)."""


_DONE = _Done()


class TtsServiceClient(ServiceClient):
    """One multiplexed WebSocket to the TTS service: many clauses in flight, matched by id."""

    what = "TTS service"
    service = "tts"
    protocol = PROTOCOL
    max_size = MAX_FRAME

    def __init__(self, cfg: RemoteTtsConfig, *, loop: LoopLateness | None = None) -> None:
        super().__init__(cfg, loop=loop)
        self.cfg: RemoteTtsConfig = cfg
        self._clauses: dict[int, _Clause] = {}
        # The rate its first hello must give: the other services' (RemoteTts.start), for a
        # service that did not answer at start and joins later.
        self.expect_rate: int | None = None

    @property
    def open_clauses(self) -> int:
        return len(self._clauses)

    def check_hello(self, hello: dict[str, Any]) -> None:
        rate = hello.get("sample_rate")
        if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
            raise ServiceMismatch(f"TTS service {self.cfg.url} gave no sample rate (a positive integer): {rate!r}")
        if self.hello is not None and rate != self.hello.get("sample_rate"):
            raise ValueError(f"TTS service now synthesises at {rate} Hz, not {self.hello.get('sample_rate')}")
        if self.hello is None and self.expect_rate is not None and rate != self.expect_rate:
            raise ValueError(f"TTS service {self.cfg.url} synthesises at {rate} Hz, the others at {self.expect_rate}")

    def _deliver(self, clause: _Clause, item: np.ndarray | BaseException) -> None:
        if isinstance(item, BaseException):
            if clause.end is None:
                clause.end = item
        else:
            if len(clause.chunks) >= clause.window:
                raise ValueError(f"TTS service sent clause {clause.id} more than its window of {clause.window}")
            clause.chunks.append(item)
            clause.got_audio = True
        clause.arrived.set()

    def _on_message(self, msg: str | bytes) -> None:
        if isinstance(msg, bytes):
            header, body = split_frame(msg, "audio")
            clause = self._clauses.get(header["id"])
            if clause is not None:  # else cancelled meanwhile
                self._deliver(clause, samples_of(body, "audio"))
            return
        data = json.loads(msg)
        clause = self._clauses.get(data.get("id"))
        if clause is None:
            return
        if data.get("type") == "done":
            self._deliver(clause, _DONE)
        elif data.get("type") == "error":
            code = str(data.get("code") or "engine_error")
            message = f"TTS service: {data.get('message', code)}"
            # The service's "busy" is a full queue, as CapacityError is in-process: the
            # clause's problem, not the engine's (no failure_streak, no health).
            full = code in ("busy", CapacityError.code)
            self._deliver(clause, CapacityError(message) if full else EngineError(message, code=code))

    def _lose_all(self, lost: ServiceLost) -> None:
        clauses, self._clauses = self._clauses, {}
        for clause in clauses.values():
            self._deliver(clause, lost)

    async def _start_clause(self, text: str, voice: str | None, speed: float | None,
                            ahead_s: float) -> tuple[ClientConnection, _Clause]:
        try:
            await self.connect()
        except CONNECT_ERRORS as exc:
            raise ServiceLost(f"cannot connect to {self.cfg.url}: {exc}") from exc
        ws = self._ws
        if ws is None:
            raise ServiceLost(f"connection to {self.cfg.url} lost")
        clause = _Clause(next(self._ids), self.cfg.window)
        self._clauses[clause.id] = clause
        request = {"type": "synthesize", "id": clause.id, "text": text, "voice": voice, "speed": speed,
                   "window": clause.window, "ahead_s": ahead_s}
        try:
            await ws.send(json.dumps(request))
        except websockets.ConnectionClosed as exc:
            self._clauses.pop(clause.id, None)
            raise ServiceLost(f"connection to {self.cfg.url} lost: {exc}") from exc
        except BaseException:
            # Cancelled (a barge-in) while the send waited to drain: the frame may be on the
            # wire already, so the service would synthesise it and wait for acks nobody sends.
            self._clauses.pop(clause.id, None)
            self._send_soon(ws, {"type": "cancel", "id": clause.id})
            raise
        return ws, clause

    async def _next(self, ws: ClientConnection, clause: _Clause) -> np.ndarray | None:
        """The clause's next chunk (acknowledged to the service), or None at its end."""
        while not clause.chunks and clause.end is None:
            clause.arrived.clear()
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.cfg.chunk_timeout_s):
                    await clause.arrived.wait()
            except TimeoutError:
                raise self._timed_out(
                    f"TTS service sent no audio in {self.cfg.chunk_timeout_s:g} s", "tts_timeout", started
                ) from None
        if clause.chunks:
            self._send_soon(ws, {"type": "ack", "id": clause.id})
            return clause.chunks.popleft()
        if clause.end is _DONE:
            return None
        assert clause.end is not None
        raise clause.end

    async def stream(self, text: str, voice: str | None, speed: float | None,
                     ahead_s: float = 0.0) -> AsyncGenerator[np.ndarray, None]:
        """One clause's chunks; closing or cancelling it cancels the synthesis at the service."""
        for attempt in itertools.count():
            try:
                ws, clause = await self._start_clause(text, voice, speed, ahead_s)
            except ServiceLost as exc:
                await self._retry_or_raise(exc, attempt)
                continue
            finished = False
            try:
                while (chunk := await self._next(ws, clause)) is not None:
                    yield chunk
                finished = True
                return
            except ServiceLost as exc:
                finished = True  # the service dropped the clause with the connection
                if clause.got_audio:  # never asked for twice once audio came
                    raise self._unavailable(exc) from exc
                lost = exc
            except EngineError:
                finished = clause.end is not None  # the service's error ended it there; a timeout did not
                raise
            finally:
                self._clauses.pop(clause.id, None)
                if not finished:
                    self._send_soon(ws, {"type": "cancel", "id": clause.id})
            await self._retry_or_raise(lost, attempt)

    def _unavailable(self, exc: BaseException) -> EngineError:
        return EngineError(f"TTS service {self.cfg.url} unavailable: {exc}", code="tts_unavailable")

    async def _retry_or_raise(self, exc: ServiceLost, attempt: int) -> None:
        if attempt >= self.cfg.retries or self._closed:
            raise self._unavailable(exc) from exc
        log.info("TTS service: %s; retry %d", exc, attempt + 1)
        await asyncio.sleep(self.cfg.retry_backoff_s * 2**attempt)
