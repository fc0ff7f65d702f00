"""Finals only (``asr.partials: false``): no partial decode at all; each turn's audio is
decoded once, as its final, and turn-taking goes on from VAD and Smart Turn alone.

Two levels. The stream on every backend (faster-whisper's engine with a counting decoder,
Whisper on vLLM with a scripted runner, the shared ASR service over a real localhost
WebSocket): audio pushed for many partial intervals and a QUIET's decode request start no
decode; ``finalize`` decodes once, at final priority. Then a whole call on a virtual
clock with the real engine and stream: the caller's turn ends (silence rule, and Smart
Turn with a scripted model), the final and the reply come, and no partial decode ran and
no partial transcript reached the client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import Future

import numpy as np
import pytest
from fake_whisper import WAIT, FakeWhisper
from fakes import RATE, FakeLlm, FakeTts, FakeVad, call, until

from voicebot.config import AsrConfig, Config, RemoteAsrConfig
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.asr.jobs import DecodeJob, Priority
from voicebot.engines.asr.remote import RemoteAsrEngine
from voicebot.engines.asr.vllm_whisper import VllmAsrEngine, WhisperVllmSettings
from voicebot.engines.registry import Engines
from voicebot.services.asr_service import AsrService, listen
from voicebot.session import events as ev
from voicebot.session.clock import Clock, VirtualClock

WORDS = "please book a table for two at eight tonight".split()


class CountingDecoder:
    """A :class:`~voicebot.engines.asr.jobs.Decoder` noting each job's priority; a decode
    takes ``delay_s`` of ``clock`` and says one word per 0.25 s of audio."""

    name = "counting"
    samples = False
    slots = 2

    def __init__(self, clock: Clock | None = None, delay_s: float = 0.0) -> None:
        self.clock = clock
        self.delay_s = delay_s
        self.priorities: list[Priority] = []

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def abandon(self, job: DecodeJob) -> None: ...

    async def decode(self, job: DecodeJob) -> tuple[str, float]:
        assert job.audio is not None
        self.priorities.append(job.priority)
        if self.clock is not None:
            await self.clock.sleep(self.delay_s)
        return " ".join(WORDS[: max(1, int(job.audio.size / RATE * 4))]), self.delay_s


def finals_only(**more: object) -> AsrConfig:
    return AsrConfig(partials=False, partial_interval_ms=200, agreement_n=2, **more)  # type: ignore[arg-type]


def speech(seconds: float) -> np.ndarray:
    return np.full(int(seconds * RATE), 0.1, dtype=np.float32)


@contextlib.asynccontextmanager
async def local_engine() -> AsyncIterator[tuple[AsrEngine, list[Priority]]]:
    decoder = CountingDecoder()
    async with AsrEngine(finals_only(), "fake", decoder=decoder) as engine:
        yield engine, decoder.priorities


@contextlib.asynccontextmanager
async def vllm_engine() -> AsyncIterator[tuple[AsrEngine, list[Priority]]]:
    fake = FakeWhisper()
    engine = VllmAsrEngine(finals_only(backend="vllm"), "fake-whisper", agreement_n=2,
                           settings=WhisperVllmSettings(concurrency=4), runner=fake)
    seen: list[Priority] = []
    async with engine:
        yield engine, seen
    seen += [Priority(c["priority"]) for c in fake.calls]  # type: ignore[call-overload]


@contextlib.asynccontextmanager
async def remote_engine() -> AsyncIterator[tuple[AsrEngine, list[Priority]]]:
    """The frontend's engine against the real service, whose own engine has partials on:
    whether a partial is asked for is the frontend's stream's decision."""
    fake = FakeWhisper()
    service_engine = VllmAsrEngine(AsrConfig(backend="vllm"), "fake-whisper", settings=WhisperVllmSettings(concurrency=4),
                                   runner=fake)
    seen: list[Priority] = []
    async with service_engine:
        svc = AsrService(service_engine, slots=4, queue_size=64, backend="vllm")
        svc.start()
        try:
            async with listen(svc, "127.0.0.1", 0) as server:
                host, port = next(iter(server.sockets)).getsockname()[:2]
                remote = RemoteAsrConfig(url=f"ws://{host}:{port}", startup_timeout_s=2.0)
                async with RemoteAsrEngine(finals_only(backend="remote", remote=remote), agreement_n=2) as engine:
                    yield engine, seen
        finally:
            await svc.aclose()
    seen += [Priority(c["priority"]) for c in fake.calls]  # type: ignore[call-overload]
    assert svc.stats.partials == 0 and svc.stats.finals == 1


BACKENDS = {"faster-whisper": local_engine, "vllm": vllm_engine, "remote": remote_engine}


@pytest.mark.parametrize("backend", list(BACKENDS))
async def test_a_finals_only_stream_decodes_its_audio_once_as_the_final(backend: str) -> None:
    priorities: list[Priority] = []
    async with BACKENDS[backend]() as (engine, seen):
        stream = engine.stream()
        for _ in range(20):  # 2 s in 100 ms pushes: ten partial intervals
            stream.push(speech(0.1))
            await asyncio.sleep(0)
        stream.request_partial(2.0)  # what a QUIET asks: nothing, with finals only
        stream.request_partial()
        await asyncio.sleep(0.05)
        assert engine.stats.partial_decodes == 0 and engine.queue_depth == 0
        final = await asyncio.wait_for(stream.finalize(2.0), WAIT)
        assert final.text and final.audio_s == pytest.approx(2.0)
        assert engine.stats.final_decodes == 1 and engine.stats.partial_decodes == 0
        stream.reset()
        stream.push(speech(0.5))
        with pytest.raises(TimeoutError):  # a partial would come by async for; none does
            await asyncio.wait_for(anext(stream), 0.1)
        await stream.aclose()
        priorities = seen
    assert priorities == [Priority.FINAL], priorities


def make(clock: VirtualClock, tokenizer: object, **vad: object) -> tuple[Engines, CountingDecoder]:
    cfg = Config.model_validate({
        "asr": {"partials": False, "partial_interval_ms": 300},
        "vad": {"min_speech_ms": 96, "speculative_silence_ms": 160, "min_silence_ms": 480, **vad},
        "session": {"playout_lead_ms": 0, "out_queue_frames": 4096},
    })
    decoder = CountingDecoder(clock, delay_s=0.2)
    asr = AsrEngine(cfg.asr, "fake", decoder=decoder)
    asr.clock = clock  # type: ignore[attr-defined]  # fakes.call() reads the call's clock there
    return Engines(cfg, asr, FakeLlm(tokenizer, clock=clock), FakeTts(clock), FakeVad()), decoder  # type: ignore[arg-type]


class FinishedModel:
    """An end-of-turn model that hears every turn as finished."""

    def __init__(self) -> None:
        self.asked = 0

    def submit(self, audio16k: np.ndarray) -> Future[float]:
        self.asked += 1
        fut: Future[float] = Future()
        fut.set_result(0.9)
        return fut


@pytest.mark.parametrize("detector", ["silence", "smart_turn"])
async def test_a_finals_only_call_takes_turns_and_replies_without_a_partial(tokenizer, detector: str) -> None:  # type: ignore[no-untyped-def]
    clock = VirtualClock()
    smart = {"turn_detector": "smart_turn", "smart_turn_check_ms": 192} if detector == "smart_turn" else {}
    engines, decoder = make(clock, tokenizer, **smart)
    model = FinishedModel()
    if smart:
        engines.turn_model = model  # type: ignore[assignment]
    async with engines.asr, call(engines) as c:  # type: ignore[attr-defined]
        for _turn in range(2):
            before = len(c.of(ev.ResponseDone))
            await c.speak(2000)  # six partial intervals of speech
            await c.silence(700)
            await until(clock, lambda: len(c.of(ev.ResponseDone)) > before, timeout=10)  # noqa: B023
            await c.silence(1500)  # the reply plays out
    finals = c.of(ev.TranscriptFinal)
    assert len(finals) == 2 and all(len(f.text.split()) >= 7 for f in finals), finals  # each heard ~2 s of speech
    assert [d.status for d in c.of(ev.ResponseDone)] == ["completed"] * 2
    assert not c.of(ev.TranscriptPartial)
    assert decoder.priorities == [Priority.FINAL] * 2, decoder.priorities  # one decode per turn
    assert model.asked == (2 if smart else 0)
