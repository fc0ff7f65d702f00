"""The frontend half of a shared streaming ASR service (``asr.backend: remote`` with
``asr.remote.engine: fastconformer``).

On one GPU, a streaming FastConformer in every frontend time-slices the GPU with the
others and steps behind each frontend's GIL (docs/gpu-results.md). ``voicebot asr-serve``
hosts ONE engine instead, whose batched step takes every frontend's streams; this module is
what a frontend runs in its place. Unlike the Whisper service (:mod:`.remote`), nothing of
the stream stays here: the service holds the encoder state, so each call's audio goes there
as it comes and partials and finals come back (:mod:`voicebot.services.asr_stream_client`
has the wire format and the connection).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import numpy as np

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig
from voicebot.engines.asr.partials import PartialQueue, PartialStream
from voicebot.engines.asr.stream import as_mono_f32
from voicebot.engines.contracts import AsrStats, Partial, Transcript
from voicebot.errors import EngineError
from voicebot.runtime.loop_lag import LoopLateness
from voicebot.services.asr_stream_client import AsrStreamsClient
from voicebot.services.wire import ServiceLost, connect_at_start

__all__ = ["RemoteStream", "RemoteStreamingAsr"]

log = logging.getLogger(__name__)


class RemoteStreamingAsr:
    """The :class:`~voicebot.engines.contracts.Asr` contract over the service's streams."""

    def __init__(self, cfg: AsrConfig, model_path: str = "", *, client: AsrStreamsClient | None = None,
                 loop: LoopLateness | None = None) -> None:
        self.cfg = cfg
        self.model_path = model_path or cfg.remote.url
        self.stats = AsrStats()
        self.client = client or AsrStreamsClient(cfg.remote, self._on_event, self._on_lost, loop=loop)
        self._streams: dict[int, RemoteStream] = {}
        self._ids = itertools.count(1)
        self._closed = False

    async def start(self) -> None:
        rcfg = self.cfg.remote
        took = await connect_at_start(self.client, rcfg.startup_timeout_s)
        await self.client.start()
        hello = self.client.hello or {}
        log.info("ASR: the shared streaming service at %s (%s, %s, %s stream slots) in %.1f s",
                 rcfg.url, hello.get("backend"), hello.get("model"), hello.get("slots"), took)

    async def aclose(self) -> None:
        self._closed = True
        for stream in list(self._streams.values()):
            stream.fail(EngineError("ASR engine closed", code="asr_unavailable"), close=True)
        await self.client.aclose()

    async def __aenter__(self) -> RemoteStreamingAsr:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def queue_depth(self) -> int:
        """Finals asked for and not answered."""
        return sum(len(s.finals) for s in self._streams.values())

    def stream(self, *, language: str | None = None) -> RemoteStream:
        """A new stream; a service with no free slot fails it (``capacity_exceeded`` at its
        final) rather than this call, which cannot wait for the answer."""
        if self._closed:
            raise EngineError("ASR engine is not running", code="asr_unavailable")
        stream = RemoteStream(self, next(self._ids))
        self._streams[stream.id] = stream
        stream.open()
        return stream

    async def transcribe(self, audio: np.ndarray, *, language: str | None = None) -> Transcript:
        async with self.stream(language=language) as stream:
            stream.push(audio)
            return await stream.finalize()

    def release(self, stream: RemoteStream) -> None:
        self._streams.pop(stream.id, None)

    # -- what the service says ------------------------------------------------------------

    def _on_event(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "partials":
            for sid, utt, confirmed, tentative, audio_s in data.get("items", []):
                stream = self._streams.get(sid)
                if stream is not None and stream.utt == utt:
                    self.stats.partial_decodes += 1
                    stream.partials.put(Partial(confirmed, tentative, audio_s))
            return
        stream = self._streams.get(data.get("stream"))  # type: ignore[arg-type]
        if stream is None:
            return  # closed meanwhile
        if kind == "final":
            waiter = stream.finals.pop(data.get("id"), None)  # type: ignore[arg-type]
            if waiter is not None and not waiter.done():
                self.stats.final_decodes += 1
                waiter.set_result(Transcript(str(data["text"]), float(data["audio_s"]), float(data["decode_s"])))
        elif kind == "error":
            self.stats.failed_decodes += 1
            code = str(data.get("code") or "engine_error")
            exc = EngineError(f"ASR service: {data.get('message', code)}", code=code)
            if data.get("id") is None:
                stream.fail(exc)  # the stream itself: refused at open, or its engine step failed
            else:
                waiter = stream.finals.pop(data["id"], None)
                if waiter is not None and not waiter.done():
                    waiter.set_exception(exc)

    def _on_lost(self, lost: ServiceLost) -> None:
        if self._closed:
            return
        exc = EngineError(f"ASR service {self.cfg.remote.url} unavailable: {lost}", code="asr_unavailable")
        for stream in list(self._streams.values()):
            stream.fail(exc)


class RemoteStream(PartialStream):
    """One call's stream, held by the service. Event loop only."""

    def __init__(self, engine: RemoteStreamingAsr, sid: int) -> None:
        self.engine = engine
        self.id = sid
        self.utt = 0  # utterances begun (reset() counts them; the service tags partials with it)
        self.partials = PartialQueue()
        self.finals: dict[int, asyncio.Future[Transcript]] = {}
        self._final_ids = itertools.count(1)
        self._samples = 0
        self._failed: EngineError | None = None  # the service lost or refused this stream
        self._closed = False

    @property
    def buffered_s(self) -> float:
        return self._samples / ASR_RATE

    def open(self) -> None:
        self._failed = None
        self.engine.client.control({"type": "open", "stream": self.id, "utt": self.utt})

    def push(self, audio: np.ndarray) -> None:
        if self._closed:
            raise RuntimeError("push() on a closed ASR stream")
        audio = as_mono_f32(audio)
        if audio.size == 0:
            return
        self._samples += audio.size
        if self._failed is None:  # a failed stream's utterance is lost until its next reset
            # A copy: it waits up to a flush, and the caller may reuse its buffer meanwhile.
            self.engine.client.push(self.id, audio.copy())

    def request_partial(self, covering_s: float | None = None) -> None:
        """Nothing to ask: the service decodes every chunk as it arrives."""

    async def finalize(self, covering_s: float | None = None) -> Transcript:
        if self._closed:
            raise RuntimeError("finalize() on a closed ASR stream")
        if self._failed is not None:
            raise self._failed
        fid = next(self._final_ids)
        waiter: asyncio.Future[Transcript] = asyncio.get_running_loop().create_future()
        self.finals[fid] = waiter
        self.engine.client.control({"type": "finalize", "stream": self.id, "id": fid})
        timeout = self.engine.cfg.remote.decode_timeout_s
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            raise self.engine.client.timed_out(f"ASR service gave no final in {timeout:g} s", "asr_timeout",
                                               started) from None
        finally:
            self.finals.pop(fid, None)

    def reset(self) -> None:
        self.utt += 1
        self._samples = 0
        self.partials.clear()  # previews of the old utterance are stale
        if self._closed:
            return
        if self._failed is not None:
            self.open()  # again, on whichever connection the client has by then
        else:
            self.engine.client.control({"type": "reset", "stream": self.id})

    async def aclose(self) -> None:
        if self._closed:
            return
        if self._failed is None:
            self.engine.client.control({"type": "close", "stream": self.id})
        self.fail(EngineError("ASR stream closed", code="asr_unavailable"), close=True)

    def fail(self, exc: EngineError, *, close: bool = False) -> None:
        """Fail the waiting finals; the stream is lost at the service until its next reset
        (``close``: for good)."""
        finals, self.finals = self.finals, {}
        for waiter in finals.values():
            if not waiter.done():
                waiter.set_exception(exc)
        self._failed = exc
        self.engine.client.forget(self.id)
        if close and not self._closed:
            self._closed = True
            self.engine.release(self)
            self.partials.put(None)
