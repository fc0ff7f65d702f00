"""Fakes of the engine contracts (voicebot/engines/contracts.py) and a scripted caller,
for tests of the call without real engines: timing-exact and fast.

Time is virtual (:class:`VirtualClock`): the fakes' delays, the caller's 20 ms audio
frames and the session's pacer all run on it, so the tests are exact on a loaded
machine and take no wall-clock time to speak or wait. ``make_engines(tokenizer)`` builds
the fake engines (the ``tokenizer`` fixture of conftest.py); ``call(engines)`` opens a
session with a :class:`Caller` that speaks, pauses and waits for events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from voicebot.config import Config
from voicebot.engines.contracts import GenerationStats, Partial, TextDelta, Transcript
from voicebot.engines.registry import Engines
from voicebot.errors import EngineError
from voicebot.session.clock import REAL_CLOCK, Clock, VirtualClock
from voicebot.session.session import Session
from voicebot.session.settings import SessionSettings

RATE = 16000
FRAME = 320


class StepClock:
    """A monotonic clock the test moves by hand (``clock.t += 0.25``): rate limits and
    token buckets take it as their ``clock``."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeLoopWatch:
    """The server's loop watch as an engine's client sees it (runtime/loop_lag.py's
    LoopLateness): says whether the loop was late for a wait, and counts the questions."""

    def __init__(self, late: bool) -> None:
        self.late = late
        self.asked = 0

    def was_late_since(self, started: float) -> bool:
        self.asked += 1
        return self.late


class FakeVadStream:
    """Speech is any window whose RMS is above 0.01."""

    def __init__(self, vad: FakeVad) -> None:
        self._vad = vad
        self._rest = np.zeros(0, dtype=np.float32)

    def process(self, audio: np.ndarray) -> np.ndarray:
        audio = np.concatenate([self._rest, audio])
        n = audio.size // 512
        self._vad.windows.append(n)
        if self._vad.on_process is not None:
            self._vad.on_process(n)
        self._rest = audio[n * 512 :]
        windows = audio[: n * 512].reshape(n, 512)
        return (np.sqrt((windows**2).mean(axis=1)) > 0.01).astype(np.float32) * 0.9

    def reset(self) -> None:
        self._rest = np.zeros(0, dtype=np.float32)


class FakeVad:
    def __init__(self) -> None:
        self.windows: list[int] = []  # 32 ms windows per process() call
        self.on_process: Callable[[int], None] | None = None

    def stream(self) -> FakeVadStream:
        return FakeVadStream(self)


class FakeAsrStream:
    def __init__(self, engine: FakeAsr) -> None:
        self.engine = engine
        self.samples = 0
        self.closed = False
        self._partials: asyncio.Queue[Partial | None] = asyncio.Queue()

    def push(self, audio: np.ndarray) -> None:
        self.samples += audio.size

    @property
    def buffered_s(self) -> float:
        return self.samples / RATE

    def request_partial(self, covering_s: float | None = None) -> None:
        self.engine.partial_requests += 1

    async def finalize(self, covering_s: float | None = None) -> Transcript:
        self.engine.finals += 1
        await self.engine.clock.sleep(0.03)
        if self.engine.fail:
            raise EngineError("ASR decode failed: out of memory")
        # Like the real stream, the decode sees the buffer as it is when it runs.
        self.engine.final_audio_s.append(round(self.samples / RATE, 3))
        return Transcript(self.engine.text, self.samples / RATE, 0.03)

    def reset(self) -> None:
        self.samples = 0

    def hear(self, text: str) -> None:
        """A partial transcript, as the real stream yields one: the words heard so far."""
        self._partials.put_nowait(Partial(text, "", 0.0))

    def __aiter__(self) -> FakeAsrStream:
        return self

    async def __anext__(self) -> Partial:
        item = await self._partials.get()
        if item is None:
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.closed += 1
            self._partials.put_nowait(None)


@dataclass
class FakeAsr:
    text: str = "what is the weather like"
    finals: int = 0
    partial_requests: int = 0
    fail: bool = False
    queue_depth: int = 0
    clock: Clock = REAL_CLOCK
    streams: list[FakeAsrStream] = field(default_factory=list)
    closed: int = 0
    final_audio_s: list[float] = field(default_factory=list)

    def stream(self, *, language: str | None = None) -> FakeAsrStream:
        self.streams.append(FakeAsrStream(self))
        return self.streams[-1]


@dataclass
class FakeLlm:
    tokenizer: object
    reply: str = "It is sunny and warm today, with a light breeze from the west and no rain at all."
    word_delay: float = 0.02
    fail: bool = False
    started: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)  # of each reply, as started
    aborted: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    running: int = 0
    background_waiting: int = 0
    cache_hit_ratio: float = 0.0
    keeps_prefills: bool = True  # a prefix cache keeps what warm() computes
    clock: Clock = REAL_CLOCK
    # (prompt, cached) token counts set with the last token, as the remote backend
    # learns them from the stream's final usage block.
    usage_at_end: tuple[int, int] | None = None

    async def generate(self, prompt_ids: list[int], *, stats: GenerationStats | None = None,
                       max_tokens: int | None = None, **_: object) -> AsyncIterator[TextDelta]:
        """One token per word of ``reply``, at most ``max_tokens`` of them (then
        finish_reason "length", as vLLM)."""
        rid = f"r{len(self.started)}"
        self.started.append(rid)
        self.prompts.append(list(prompt_ids))
        finished = False
        words = self.reply.split()
        try:
            if self.fail:
                raise EngineError("the model fell over")
            if stats is not None:
                stats.finish_reason = "length" if max_tokens is not None and len(words) > max_tokens else "stop"
            for i, word in enumerate(words[:max_tokens]):
                await self.clock.sleep(self.word_delay)
                if stats is not None and stats.first_token_at is None:
                    stats.first_token_at = self.clock.monotonic()
                yield TextDelta(("" if i == 0 else " ") + word, 1)
            if stats is not None and self.usage_at_end is not None:
                stats.prompt_tokens, stats.cached_tokens = self.usage_at_end
                stats.cached_known = True
            finished = True
            self.completed.append(rid)
        finally:
            if not finished:
                self.aborted.append(rid)

    # Background summaries: how many at once, what they were asked, how they ended.
    summary_delay: float = 0.0
    summary_fail: bool = False
    summary_prompts: list[str] = field(default_factory=list)
    summarising: int = 0
    most_summarising: int = 0
    summaries_cancelled: int = 0

    # Prefills of the conversation (llm.warm_prefix): their prompts, and how they ended.
    block_size: int = 16
    warm_delay: float = 0.0
    warmed: list[list[int]] = field(default_factory=list)
    warms_cancelled: int = 0

    async def warm(self, prompt_ids: list[int], cached: int = 0, on_piece: Callable[[int], None] | None = None) -> None:
        try:
            await self.clock.sleep(self.warm_delay)
        except asyncio.CancelledError:
            self.warms_cancelled += 1
            raise
        self.warmed.append(list(prompt_ids))
        if on_piece is not None:
            on_piece(len(prompt_ids))

    async def complete(self, prompt_ids: list[int], **kw: object) -> str:
        self.summarising += 1
        self.most_summarising = max(self.most_summarising, self.summarising)
        try:
            self.summary_prompts.append(self.tokenizer.decode(prompt_ids))  # type: ignore[attr-defined]
            await self.clock.sleep(self.summary_delay)
            if self.summary_fail:
                raise EngineError("background lane: out of KV cache")
            return f"Summary {len(self.summary_prompts)}."
        except asyncio.CancelledError:
            self.summaries_cancelled += 1
            raise
        finally:
            self.summarising -= 1


class FakeTts:
    """100 ms of tone per word, one chunk per clause."""

    sample_rate = RATE
    queue_depth = 0

    def __init__(self, clock: Clock = REAL_CLOCK, delay: float = 0.005) -> None:
        self.clock = clock
        self.delay = delay
        self.started = 0
        self.finished = 0
        self.aborted = 0
        self.texts: list[str] = []  # as asked to speak

    def voices(self) -> list[str]:
        return ["fake"]

    async def synthesize(self, text: str, *, voice: str | None = None, speed: float | None = None,
                         ahead_s: float = 0.0) -> AsyncIterator[np.ndarray]:
        self.started += 1
        self.texts.append(text)
        done = False
        try:
            await self.clock.sleep(self.delay)
            yield np.full(len(text.split()) * RATE // 10, 0.2, dtype=np.float32)
            done = True
        finally:
            if done:
                self.finished += 1
            else:
                self.aborted += 1




def make_engines(tokenizer, clock: Clock | None = None, **llm_kw) -> Engines:  # type: ignore[no-untyped-def]
    """Fake engines; every delay runs on ``clock`` (a fresh VirtualClock by default)."""
    clock = clock or VirtualClock()
    cfg = Config.model_validate(
        {
            "vad": {"min_speech_ms": 96, "speculative_silence_ms": 160, "min_silence_ms": 480, "barge_in_min_ms": 192},
            "session": {"playout_lead_ms": 0, "out_queue_frames": 4096},
        }
    )
    return Engines(
        cfg, FakeAsr(clock=clock), FakeLlm(tokenizer, clock=clock, **llm_kw), FakeTts(clock), FakeVad()  # type: ignore[arg-type]
    )


def clock_of(engines: Engines) -> Clock:
    return engines.asr.clock  # type: ignore[attr-defined, no-any-return]


def with_session_cfg(engines: Engines, **changes: object) -> None:
    engines.cfg = engines.cfg.model_copy(update={"session": engines.cfg.session.model_copy(update=changes)})


async def elapse(clock: Clock, seconds: float) -> None:
    """Let ``seconds`` pass: virtual time is moved on, real time is waited for."""
    if isinstance(clock, VirtualClock):
        await clock.advance(seconds)
    else:
        await asyncio.sleep(seconds)


async def until(clock: Clock, condition: Callable[[], object], timeout: float = 5.0) -> None:
    """Let time pass until ``condition()`` holds (``timeout`` seconds of that clock)."""
    deadline = clock.monotonic() + timeout
    while not condition():
        if clock.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        await elapse(clock, 0.01)


class Caller:
    def __init__(self, session: Session, clock: Clock) -> None:
        self.session = session
        self.clock = clock
        self.events: list[object] = []
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        async for e in self.session.events():
            self.events.append(e)

    async def speak(self, ms: int) -> None:
        await self._push(ms, 0.1)

    async def silence(self, ms: int) -> None:
        await self._push(ms, 0.0)

    async def _push(self, ms: int, level: float) -> None:
        """One 20 ms frame every 20 ms of the clock, as a real-time client sends."""
        start = self.clock.monotonic()
        for i in range(ms // 20):
            self.session.push_audio(np.full(FRAME, level, dtype=np.float32), RATE)
            await elapse(self.clock, max(0.0, start + (i + 1) * 0.02 - self.clock.monotonic()))

    async def pause(self, seconds: float) -> None:
        await elapse(self.clock, seconds)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    async def wait_for(self, kind: type, timeout: float = 5.0):  # type: ignore[no-untyped-def]
        await until(self.clock, lambda: self.of(kind), timeout)
        return self.of(kind)[0]

    async def close(self) -> None:
        await self.session.aclose()
        await asyncio.wait([self._task], timeout=2)


@contextlib.asynccontextmanager
async def call(engines: Engines, **settings: object) -> AsyncIterator[Caller]:
    base = SessionSettings.from_config(engines.cfg).model_copy(update=settings)
    clock = clock_of(engines)
    session = Session(engines, base, clock=clock)
    async with session:
        caller = Caller(session, clock)
        try:
            yield caller
        finally:
            await caller.close()


LONG_INSTRUCTIONS = "You are the booking line of a small hotel. " + " ".join(
    f"Rule {i}: be brief and polite about room {i}." for i in range(20)
)
