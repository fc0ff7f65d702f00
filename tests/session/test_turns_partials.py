"""A breath after the pause must not put a Whisper decode beside the reply's LLM prefill.

Traced on the 2-core default (benchmarks/trace_serve.py, docs/benchmarks.md "Issue 12
§4"): the slow TTFTs (660-960 ms against 230-350 ms) were the turns where a breath or
a soft tail after the last word (VAD probability between the in-speech hysteresis, 0.35,
and the speech threshold, 0.5) gave PAUSE -> RESUME -> QUIET -> PAUSE -> END. The second
QUIET forced a partial decode although the end of speech had not moved (a breath under
0.5 is not speech): the final was taken at once from the partial that already covered
it, the LLM request went out, and the useless partial ran beside its prefill on the same
two cores. The same happened when the 1 s interval partial started at the last word.
QUIET now asks for a decode only if no partial has seen, or is decoding, the audio up
to the end of speech (``AsrStream.request_partial(covering_s)``).

Real session, real :class:`AsrStream` and :class:`AsrEngine` scheduling; only the
decode itself (a timed fake on the virtual clock), the VAD, the LLM and the TTS are fakes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from fakes import FRAME, RATE, Caller, FakeLlm, FakeTts, call, elapse, until

from voicebot.config import Config
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.asr.jobs import DecodeJob
from voicebot.engines.contracts import GenerationStats, TextDelta
from voicebot.engines.registry import Engines
from voicebot.session import events as ev
from voicebot.session.clock import VirtualClock

DECODE_S = 0.3  # one Whisper decode on this CPU, partial or final, at 30 s (~0.3-0.55 s)
WORDS = "what time do you open on sundays and do you take cards".split()

SPEECH, BREATH = 0.1, 0.03  # frame levels the fake VAD maps to 0.9 and 0.4


class LevelVadStream:
    """0.9 for speech, 0.4 for a breath (above the in-speech hysteresis of 0.35 but under
    the 0.5 threshold, as Silero scores the tails of librivox_0890 / 0920), 0 for silence."""

    def __init__(self) -> None:
        self._rest = np.zeros(0, dtype=np.float32)

    def process(self, audio: np.ndarray) -> np.ndarray:
        audio = np.concatenate([self._rest, audio])
        n = audio.size // 512
        self._rest = audio[n * 512 :]
        rms = np.sqrt((audio[: n * 512].reshape(n, 512) ** 2).mean(axis=1))
        return np.where(rms > 0.05, 0.9, np.where(rms > 0.01, 0.4, 0.0)).astype(np.float32)

    def reset(self) -> None:
        self._rest = np.zeros(0, dtype=np.float32)


class LevelVad:
    def stream(self) -> LevelVadStream:
        return LevelVadStream()


@dataclass
class Decode:
    priority: str
    audio_s: float
    start: float
    end: float | None = None


class TimedAsr(AsrEngine):
    """The real engine (queue, priorities, workers, streams) with a decode that takes
    ``DECODE_S`` of the virtual clock: the text is one word per 0.25 s of audio."""

    def __init__(self, cfg: Config, clock: VirtualClock) -> None:
        super().__init__(cfg.asr, "fake")
        self.clock = clock
        self.decodes: list[Decode] = []

    async def start(self) -> None:
        import asyncio

        self._workers = [asyncio.create_task(self._worker()) for _ in range(self.cfg.workers)]

    async def _run_decode(self, job: DecodeJob) -> tuple[str, float]:
        assert job.audio is not None
        rec = Decode(job.priority.name.lower(), job.audio.size / RATE, self.clock.monotonic())
        self.decodes.append(rec)
        await self.clock.sleep(DECODE_S)
        rec.end = self.clock.monotonic()
        words = WORDS[: max(1, int(rec.audio_s * 4))]
        done = len(job.prefix.split()) if job.prefix else 0
        return " ".join(words[done:]), DECODE_S


@dataclass
class Prefill:
    submitted: float
    first_token: float | None = None


class TimedLlm(FakeLlm):
    """The session's fake LLM, noting when each request went out and its first token came."""

    prefills: list[Prefill] | None = None

    async def generate(  # type: ignore[override]
        self, prompt_ids: list[int], *, stats: GenerationStats | None = None, **kw: object
    ) -> AsyncIterator[TextDelta]:
        if self.prefills is None:
            self.prefills = []
        rec = Prefill(self.clock.monotonic())
        self.prefills.append(rec)
        async for delta in super().generate(prompt_ids, stats=stats, **kw):
            if rec.first_token is None:
                rec.first_token = self.clock.monotonic()
            yield delta


def make(tokenizer) -> tuple[Engines, TimedAsr, TimedLlm]:  # type: ignore[no-untyped-def]
    clock = VirtualClock()
    cfg = Config.model_validate(
        {
            # configs/default.yaml's turn and ASR timing
            "vad": {"min_speech_ms": 120, "speculative_silence_ms": 128, "min_silence_ms": 400},
            "asr": {"partial_interval_ms": 1000, "workers": 1},
            "session": {"playout_lead_ms": 0, "out_queue_frames": 4096},
        }
    )
    asr = TimedAsr(cfg, clock)
    # A prefill as long as a decode, so that a decode started with it overlaps it.
    llm = TimedLlm(tokenizer, clock=clock, word_delay=DECODE_S)
    return Engines(cfg, asr, llm, FakeTts(clock), LevelVad()), asr, llm  # type: ignore[arg-type]


async def push(c: Caller, ms: int, level: float) -> None:
    start = c.clock.monotonic()
    for i in range(ms // 20):
        c.session.push_audio(np.full(FRAME, level, dtype=np.float32), RATE)
        await elapse(c.clock, max(0.0, start + (i + 1) * 0.02 - c.clock.monotonic()))


def beside_prefill(asr: TimedAsr, llm: TimedLlm) -> list[Decode]:
    """Decodes that ran while an LLM request waited for its first token."""
    out = []
    for p in llm.prefills or []:
        assert p.first_token is not None
        for d in asr.decodes:
            end = d.end if d.end is not None else float("inf")
            if d.start < p.first_token and end > p.submitted:
                out.append(d)
    return out


async def test_a_breath_after_the_pause_leaves_the_prefill_alone(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines, asr, llm = make(tokenizer)
    await asr.start()
    try:
        async with call(engines) as c:
            await push(c, 1500, SPEECH)
            await push(c, 200, 0.0)  # QUIET (a decode at once), then PAUSE: the reply is prepared
            await push(c, 64, BREATH)  # under the threshold after silence: no RESUME, the speech end stays
            await push(c, 900, 0.0)  # QUIET, PAUSE, END
            await until(c.clock, lambda: c.of(ev.ResponseDone), timeout=10)
            assert c.of(ev.ResponseDone)[0].status == "completed"
            assert len(llm.started) == 1, "one LLM request: the speculation stands"
            # The final is the partial asked at the first QUIET: it saw the speech to its end.
            quiet = asr.decodes[1]
            assert c.of(ev.TranscriptFinal)[0].text == " ".join(WORDS[: int(quiet.audio_s * 4)])
            late = beside_prefill(asr, llm)
            assert not late, f"ASR decodes beside the LLM prefill: {late} (all: {asr.decodes})"
    finally:
        await asr.aclose()


async def test_an_interval_partial_at_the_last_word_leaves_the_prefill_alone(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The other way the same waste came about (the one slow TTFT left in the first traced
    run after the breath case was fixed): the 1 s interval partial starts just after the
    last word, a frame before QUIET; it already covers the end of speech and becomes the
    final, so the decode QUIET used to force after it only ran beside the prefill."""
    engines, asr, llm = make(tokenizer)
    await asr.start()
    try:
        async with call(engines) as c:
            await push(c, 1960, SPEECH)  # the second interval partial starts at the last word
            await push(c, 900, 0.0)
            await until(c.clock, lambda: c.of(ev.ResponseDone), timeout=10)
            interval = asr.decodes[1]
            assert interval.start < llm.prefills[0].submitted  # type: ignore[index]
            assert c.of(ev.TranscriptFinal)[0].text == " ".join(WORDS[: int(interval.audio_s * 4)])
            late = beside_prefill(asr, llm)
            assert not late, f"ASR decodes beside the LLM prefill: {late} (all: {asr.decodes})"
    finally:
        await asr.aclose()


async def test_speech_after_the_pause_is_still_decoded_for_the_final(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Real speech after the pause (not a breath) moves the end of speech: the final must
    hear it, so the decode asked at the next QUIET is still made and waited for."""
    engines, asr, llm = make(tokenizer)
    await asr.start()
    try:
        async with call(engines) as c:
            await push(c, 1500, SPEECH)
            await push(c, 200, 0.0)
            await push(c, 300, SPEECH)  # the caller goes on: "... and"
            await push(c, 900, 0.0)
            await until(c.clock, lambda: c.of(ev.ResponseDone), timeout=10)
            final = c.of(ev.TranscriptFinal)[0].text
            last = max(asr.decodes, key=lambda d: d.audio_s)
            assert last.audio_s > 1.5 + 0.3, asr.decodes  # a decode heard the speech after the pause
            assert final == " ".join(WORDS[: int(last.audio_s * 4)]), final  # and the final is it
            assert not beside_prefill(asr, llm)
    finally:
        await asr.aclose()
