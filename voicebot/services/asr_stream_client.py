"""The streams protocol of the shared ASR service, and its client: what a frontend's
:class:`~voicebot.engines.asr.remote_streams.RemoteStreamingAsr` speaks to a ``voicebot
asr-serve`` that hosts a streaming engine (``asr.remote.engine: fastconformer``).

A cache-aware streaming engine encodes each chunk of audio once, as it arrives, and keeps
per-stream state between chunks: it cannot take whole utterances per decode (protocol 1,
:mod:`.asr_client`). Here the service holds each call's stream and the frontend sends the
audio as it comes; the service sends partials as its steps make them and a final when asked.

Wire format (protocol 2; the hello also says ``"mode": "streams"``):

- frontend -> service, text: ``{"type": "open", "stream", "utt"}`` (a stream in a free slot;
  ``utt``: the frontend's utterance count, which partials are tagged with),
  ``{"type": "finalize", "stream", "id"}``, ``{"type": "reset", "stream"}`` (a new utterance:
  ``utt`` + 1 on both sides), ``{"type": "close", "stream"}``, ``{"type": "stats"}``;
- frontend -> service, binary: every stream's audio since the last frame, in ONE frame: a
  4-byte big-endian header length, ``{"type": "audio", "id": N, "streams": [[stream,
  samples], ...]}``, then the streams' float32 samples back to back. One frame per flush
  (``asr.remote.stream_flush_ms``), not one per call and 20 ms packet: a frontend with 200
  calls sends 25 frames a second, not 10,000;
- service -> frontend, text: ``{"type": "partials", "items": [[stream, utt, confirmed,
  tentative, audio_s], ...]}`` (the newest of each stream since the last message),
  ``{"type": "final", "stream", "id", "text", "audio_s", "decode_s"}``, and ``{"type":
  "error", "stream", "id", "code", "message"}`` (``id`` null: the stream itself failed, e.g.
  ``capacity_exceeded`` when every slot is taken).

One WebSocket per frontend carries all its streams, in order: a control message goes after
the audio pushed before it. A lost connection loses its streams' audio: their waiting finals
fail with ``asr_unavailable``, and each stream opens again on a new connection at its next
``reset`` (the next turn).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from collections.abc import Callable
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

__all__ = ["MAX_FRAME", "MAX_OUTBOX", "PROTOCOL", "AsrStreamsClient", "pack_audio", "unpack_audio"]

log = logging.getLogger(__name__)

PROTOCOL = 2
# A frame holds every stream's audio of one flush: 512 streams x 0.5 s of float32 is 16 MB.
MAX_FRAME = 32 * 1024 * 1024
# Messages waiting to be sent; more means the service stopped reading: the connection is
# dropped (its streams fail and reopen at their next turn) rather than buffering for ever.
MAX_OUTBOX = 4096


def pack_audio(frame_id: int, chunks: list[tuple[int, np.ndarray]]) -> bytes:
    header = {"type": "audio", "id": frame_id, "streams": [[sid, int(a.size)] for sid, a in chunks]}
    return pack_frame(header, np.concatenate([a for _, a in chunks]) if chunks else np.zeros(0, np.float32))


def unpack_audio(frame: bytes) -> list[tuple[int, np.ndarray]]:
    """Each stream's samples in an audio frame; ValueError when it is malformed."""
    header, body = split_frame(frame, "audio")
    items = header.get("streams")
    if not isinstance(items, list):
        raise ValueError("audio streams must be a list of [stream, samples]")
    samples = samples_of(body, "audio")
    out: list[tuple[int, np.ndarray]] = []
    at = 0
    for item in items:
        if (not isinstance(item, list) or len(item) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item)):
            raise ValueError("each audio item must be [stream, samples] of non-negative integers")
        sid, n = item
        out.append((sid, samples[at : at + n]))
        at += n
    if at != samples.size:
        raise ValueError(f"audio items count {at} samples, the frame has {samples.size}")
    return out


class AsrStreamsClient(ServiceClient):
    """One WebSocket to a streams-mode ASR service: every stream's audio batched per flush,
    control messages in order after it, events handed to ``on_event``."""

    what = "ASR service"
    service = "asr"
    protocol = PROTOCOL
    max_size = 4 * 1024 * 1024  # events are small JSON
    hint = " (asr.remote.engine says fastconformer: does the service host a Whisper engine?)"

    def __init__(self, cfg: RemoteAsrConfig, on_event: Callable[[dict[str, Any]], None],
                 on_lost: Callable[[ServiceLost], None], *, loop: LoopLateness | None = None) -> None:
        super().__init__(cfg, loop=loop)
        self.cfg: RemoteAsrConfig = cfg
        self._on_event = on_event
        self._on_lost = on_lost
        self._audio: dict[int, list[np.ndarray]] = {}  # the frame being filled, by stream
        self._outbox: collections.deque[str | bytes] = collections.deque()
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None

    def check_hello(self, hello: dict[str, Any]) -> None:
        if hello.get("mode") != "streams":
            raise ValueError(f"the ASR service at {self.cfg.url} does not host a streaming engine")

    async def start(self) -> None:
        self._sender = asyncio.create_task(self._send_loop(), name="asr-streams-sender")

    # -- what the streams send ----------------------------------------------------------

    def push(self, stream: int, audio: np.ndarray) -> None:
        self._audio.setdefault(stream, []).append(audio)
        self._wake.set()

    def control(self, payload: dict[str, Any]) -> None:
        """A control message, sent after every sample pushed before it, without waiting for
        the next flush."""
        self._seal()
        self._outbox.append(json.dumps(payload))
        self._wake.set()
        self._urgent.set()

    def timed_out(self, message: str, code: str, started: float) -> EngineError:
        """A stream's final not answered in time (the service's failure, or our late loop's)."""
        return self._timed_out(message, code, started)

    def forget(self, stream: int) -> None:
        """A stream lost with its connection: its audio not yet sealed is not sent."""
        self._audio.pop(stream, None)

    def _seal(self) -> None:
        if not self._audio:
            return
        chunks = [(sid, parts[0] if len(parts) == 1 else np.concatenate(parts)) for sid, parts in self._audio.items()]
        self._audio = {}
        self._outbox.append(pack_audio(next(self._ids), chunks))

    # -- the sender -----------------------------------------------------------------------

    async def _send_loop(self) -> None:
        flush_s = self.cfg.stream_flush_ms / 1000
        while True:
            await self._wake.wait()
            if not self._urgent.is_set():
                # Audio alone waits for the flush: every stream's audio goes in one frame.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(flush_s):
                        await self._urgent.wait()
            self._wake.clear()
            self._urgent.clear()
            self._seal()
            if not self._outbox:
                continue
            try:
                await self.connect()
            except CONNECT_ERRORS as exc:
                self._drop(ServiceLost(f"cannot connect to {self.cfg.url}: {exc}"))
                await asyncio.sleep(self.cfg.retry_backoff_s)
                continue
            ws = self._ws
            if ws is None:
                continue
            if len(self._outbox) > MAX_OUTBOX:
                log.warning("ASR service %s: %d messages not sent; dropping the connection", self.cfg.url,
                            len(self._outbox))
                await ws.close()
                continue  # the reader's end fails the streams (_lose_all)
            try:
                while self._outbox and ws is self._ws:
                    await ws.send(self._outbox[0])
                    self._outbox.popleft()
            except websockets.ConnectionClosed:
                continue  # the same: _lose_all from the reader

    def _drop(self, lost: ServiceLost) -> None:
        self._outbox.clear()
        self._audio.clear()
        self._on_lost(lost)

    # -- what comes back --------------------------------------------------------------------

    def _on_message(self, msg: str | bytes) -> None:
        if isinstance(msg, bytes):
            return
        data = json.loads(msg)
        if isinstance(data, dict):
            self._on_event(data)

    def _lose_all(self, lost: ServiceLost) -> None:
        # What was queued belongs to the lost connection's streams.
        self._drop(lost)

    async def aclose(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
            self._sender = None
        await super().aclose()
