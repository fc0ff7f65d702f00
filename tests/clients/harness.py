"""What every third-party client test needs: a real server, real speech, a spy on the wire.

The clients are used as their users use them, pointed at our server by base URL only;
nothing here patches a client. What the tests look at on our side is what the server
sent: :class:`WireLog` records every Realtime event the server wrote (by wrapping the
server's own translator factory), so "no error event reached the client" is checked
where it is decided, whatever the client does with errors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np

from voicebot.audio import float_to_pcm16, resample
from voicebot.config import Config, ModelsConfig, load_config
from voicebot.server.state import ServerState
from voicebot.transports import realtime as realtime_transport
from voicebot.transports.realtime_session import RealtimeTranslator

KEY = "sk-test-clients"
PCM_RATE = 24_000
TIMEOUT = 90.0  # one exchange on the shared 2-core CPU


def client_config(models: ModelsConfig, base: str, *overrides: str) -> Config:
    return load_config(base, [
        f"models.cache_dir={models.cache_dir}",
        "server.host=127.0.0.1",
        "server.port=0",
        f"server.api_key={KEY}",
        # The clients upload WAV speech faster than real time.
        "server.input_burst_ms=60000",
        *overrides,
    ])


async def speak(state: ServerState, text: str) -> np.ndarray:
    """``text`` spoken by the server's own TTS engine: float32 mono at 16 kHz."""
    assert state.engines is not None
    tts = state.engines.tts
    chunks = [np.asarray(c, dtype=np.float32) async for c in tts.synthesize(text)]
    return resample(np.concatenate(chunks), tts.sample_rate, 16_000)


def pcm24k(audio16k: np.ndarray, silence_s: float = 0.0) -> bytes:
    """16 kHz float audio as the Realtime API's audio/pcm (PCM16, 24 kHz), plus silence."""
    audio = resample(audio16k, 16_000, PCM_RATE)
    return float_to_pcm16(np.concatenate([audio, np.zeros(int(silence_s * PCM_RATE), np.float32)]))


def chunks(pcm: bytes, ms: int = 100) -> Iterator[bytes]:
    step = PCM_RATE * 2 * ms // 1000
    for i in range(0, len(pcm), step):
        yield pcm[i:i + step]


async def live_chunks(pcm: bytes, ms: int = 20) -> AsyncIterator[bytes]:
    """``chunks(pcm, ms)``, each when a live microphone would have it: chunk i at i x ms
    after the first, on the wall clock, so a pause in the speech is a pause on the wire
    (the tests otherwise upload speech faster than real time)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i, chunk in enumerate(chunks(pcm, ms)):
        await asyncio.sleep(max(0.0, start + i * ms / 1000 - loop.time()))
        yield chunk


class WireLog:
    """Every Realtime event the server sent, per connection, in order."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.received: list[str] = []

    def types(self) -> list[str]:
        return [str(e["type"]) for e in self.sent]

    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.sent if e["type"] == "error"]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.sent if e["type"] == kind]

    async def wait_for(self, check: Callable[[], bool], timeout: float = TIMEOUT) -> None:
        async with asyncio.timeout(timeout):
            while not check():
                await asyncio.sleep(0.05)


@contextlib.contextmanager
def wire_log() -> Iterator[WireLog]:
    """Record what the server's Realtime translators send and receive while active."""
    log = WireLog()
    original = realtime_transport.RealtimeTranslator

    class Recording(RealtimeTranslator):
        def _out(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
            out = super()._out(events)
            log.sent.extend(out)
            return out

        def client_message(self, text: str) -> list[dict[str, Any]]:
            log.received.append(text)
            return super().client_message(text)

    realtime_transport.RealtimeTranslator = Recording  # type: ignore[misc]
    try:
        yield log
    finally:
        realtime_transport.RealtimeTranslator = original  # type: ignore[misc]


async def wait_for(check: Callable[[], object], timeout: float = TIMEOUT) -> None:
    """Poll ``check`` until it is true (the clients run on this loop: no threads to join)."""
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.05)
