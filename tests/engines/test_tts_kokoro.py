"""``tts.engine: kokoro`` (voicebot/engines/tts/kokoro.py) over a fake model runner.

Real: espeak-ng G2P (piper-tts's copy) with Kokoro's vocabulary, voice packs read from a
directory (kokoro-js ``.bin`` layout), the batcher, the factory. Fake: the runner, i.e.
the model forward (the batcher's own interface): it records each clause and returns
``SAMPLES_PER_ID`` samples per phoneme id. No Kokoro weights are reachable offline here,
so no test runs the real model's forward on real weights (see tests/engines/test_kokoro_model.py
for the batched forward on random weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path

import numpy as np
import pytest

from voicebot.config import TtsConfig
from voicebot.engines.contracts import BatchedTts
from voicebot.engines.registry import create_tts
from voicebot.engines.tts.kokoro import MAX_TOKENS, EspeakG2P, KokoroTts, VoicePacks
from voicebot.engines.tts.kokoro_batch import Clause
from voicebot.engines.tts.kokoro_model import KOKORO_VOCAB
from voicebot.errors import CapacityError, EngineError

SAMPLES_PER_ID = 240  # 10 ms of audio per phoneme


class FakeRunner:
    def __init__(self) -> None:
        self.clauses: list[Clause] = []
        self.batches: list[int] = []
        self.blocking = False
        self.tokens = threading.Semaphore(0)
        self.entered = threading.Event()

    def __call__(self, batch: list[Clause], deliver: Callable[[list[Clause], list[np.ndarray]], None]) -> None:
        self.clauses.extend(batch)
        self.batches.append(len(batch))
        self.entered.set()
        if self.blocking:
            assert self.tokens.acquire(timeout=10)
        live = [c for c in batch if not c.future.cancelled()]
        deliver(live, [np.full(len(c.ids) * SAMPLES_PER_ID, 0.1, np.float32) for c in live])

    def open(self) -> None:
        self.blocking = False
        self.tokens.release(100)


@pytest.fixture(scope="module")
def g2p() -> EspeakG2P:
    return EspeakG2P(dict(KOKORO_VOCAB))


@pytest.fixture
def voices_dir(tmp_path: Path) -> Path:
    (tmp_path / "voices").mkdir()
    rng = np.random.default_rng(0)
    for name in ("af_test", "am_other"):  # kokoro-js layout: float32 (510, 1, 256)
        rng.normal(0, 0.15, (510, 1, 256)).astype(np.float32).tofile(tmp_path / "voices" / f"{name}.bin")
    return tmp_path


@contextlib.asynccontextmanager
async def engine(g2p: EspeakG2P, voices_dir: Path, runner: FakeRunner, **cfg: int):  # type: ignore[no-untyped-def]
    tts = KokoroTts(TtsConfig(engine="kokoro", voice="af_test", kokoro_model=str(voices_dir), **cfg),
                    runner=runner, g2p=g2p, voices=VoicePacks(str(voices_dir), voices_dir))
    await tts.start()
    try:
        yield tts
    finally:
        runner.open()
        await tts.aclose()


def test_g2p_speaks_kokoro_phonemes(g2p: EspeakG2P) -> None:
    ph = g2p.phonemes("Hello, world. It's 5 o'clock!")
    assert "ˈ" in ph and "," in ph and ph.endswith("!")
    assert set(ph) <= set(KOKORO_VOCAB)
    assert "w" in ph and "l" in ph  # "world"
    assert g2p.phonemes("") == ""


def test_g2p_cuts_long_text_at_word_boundaries(g2p: EspeakG2P) -> None:
    text = " ".join(["information"] * 80)  # ~900 phonemes
    pieces = g2p.ids(text)
    assert len(pieces) >= 2
    assert all(0 < len(p) <= MAX_TOKENS for p in pieces)
    space = KOKORO_VOCAB[" "]
    assert all(p[0] != space and p[-1] != space for p in pieces)
    full = [KOKORO_VOCAB[ch] for ch in g2p.phonemes(text)]
    assert sum(len(p) for p in pieces) + len(pieces) - 1 == len(full)  # only the cut spaces are gone


async def test_streams_one_chunk_per_sentence_with_deadlines(g2p: EspeakG2P, voices_dir: Path) -> None:
    runner = FakeRunner()
    async with engine(g2p, voices_dir, runner) as tts:
        assert tts.sample_rate == 24_000 and tts.voices() == ["af_test", "am_other"]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        chunks = [c async for c in tts.synthesize("Sure, let me check. The next train leaves at ten. **Bye** 🚆")]
    assert len(chunks) == 3 and len(runner.clauses) == 3
    first, second, third = runner.clauses
    assert [len(c) for c in chunks] == [len(c.ids) * SAMPLES_PER_ID for c in runner.clauses]
    assert "*" not in g2p.phonemes("Bye") and len(third.ids) < 10
    # The first clause is due at once; the next when playback reaches it.
    assert first.deadline - t0 < 0.5
    assert second.deadline >= first.deadline + len(first.ids) * SAMPLES_PER_ID / 24_000 - 0.01
    assert third.deadline >= second.deadline + len(second.ids) * SAMPLES_PER_ID / 24_000 - 0.01
    # The style row is picked by the clause's length (KPipeline: pack[len(ps) - 1]).
    pack = VoicePacks(str(voices_dir), voices_dir).load("af_test")
    assert np.allclose(first.style.numpy(), pack[len(first.ids) - 1].numpy())


async def test_a_clause_with_audio_ahead_of_it_is_due_when_that_audio_has_played(
    g2p: EspeakG2P, voices_dir: Path
) -> None:
    """``ahead_s``: a reply's later clause waits behind a clause the caller waits for in silence."""
    runner = FakeRunner()
    async with engine(g2p, voices_dir, runner) as tts:
        t0 = asyncio.get_running_loop().time()
        chunks = [c async for c in tts.synthesize("I can help. With that.", ahead_s=2.0)]
    first, second = runner.clauses
    assert len(chunks) == 2
    assert 2.0 <= first.deadline - t0 < 2.5
    assert second.deadline >= first.deadline + len(first.ids) * SAMPLES_PER_ID / 24_000 - 0.01


async def test_sessions_share_one_batch(g2p: EspeakG2P, voices_dir: Path) -> None:
    runner = FakeRunner()
    async with engine(g2p, voices_dir, runner, max_batch=16) as tts:
        runner.blocking = True

        async def say(text: str) -> list[np.ndarray]:
            return [c async for c in tts.synthesize(text)]

        lead = asyncio.create_task(say("One moment."))
        assert await asyncio.to_thread(runner.entered.wait, 5)
        others = [asyncio.create_task(say(f"Caller number {i} is here.")) for i in range(5)]
        await asyncio.sleep(0.05)
        assert tts.queue_depth == 5
        runner.open()
        await asyncio.gather(lead, *others)
        # What the TTS service reports of the engine's forwards (TtsService.snapshot).
        assert isinstance(tts, BatchedTts) and tts.forward_stats()["forward_rows_mean"] == 3.0
    assert runner.batches == [1, 5]


async def test_closing_a_stream_drops_its_queued_sentence(g2p: EspeakG2P, voices_dir: Path) -> None:
    runner = FakeRunner()
    async with engine(g2p, voices_dir, runner) as tts:
        runner.blocking = True
        runner.tokens.release(1)  # the first sentence goes through, the second hangs in the model
        async with aclosing(tts.synthesize("First sentence here. Second sentence there. Third one.")) as stream:
            first = await anext(stream)
            for _ in range(500):  # until the second sentence is inside the model
                if len(runner.clauses) == 2:
                    break
                await asyncio.sleep(0.01)
        assert first.size and tts.queue_depth == 0
        runner.open()
        assert [c async for c in tts.synthesize("Still works.")]
    # The second sentence was running: its audio was discarded; the third never reached the model.
    assert len(runner.clauses) == 3 and runner.batches == [1, 1, 1]
    assert tts._batcher is not None and tts._batcher.stats.discarded == 1


async def test_cancelled_consumer_drops_queued_work(g2p: EspeakG2P, voices_dir: Path) -> None:
    runner = FakeRunner()
    async with engine(g2p, voices_dir, runner) as tts:
        runner.blocking = True

        async def consume() -> None:
            async for _ in tts.synthesize("One. Two. Three."):
                pass

        blocker = asyncio.create_task(consume())
        assert await asyncio.to_thread(runner.entered.wait, 5)
        waiting = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        assert tts.queue_depth == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert tts.queue_depth == 0
        blocker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocker


async def test_full_queue_and_bad_voice_are_errors(g2p: EspeakG2P, voices_dir: Path) -> None:
    runner = FakeRunner()
    async with engine(g2p, voices_dir, runner, queue_size=1) as tts:
        with pytest.raises(EngineError, match="unknown Kokoro voice"):
            async for _ in tts.synthesize("Hi.", voice="nobody"):
                pass
        with pytest.raises(EngineError, match="bad Kokoro voice"):
            async for _ in tts.synthesize("Hi.", voice="../etc"):
                pass
        assert [c async for c in tts.synthesize("Hi.", voice="am_other")]
        assert [c async for c in tts.synthesize("  *** ")] == []
        runner.blocking = True
        runner.entered.clear()
        busy = asyncio.create_task(anext(tts.synthesize("Busy.")))
        assert await asyncio.to_thread(runner.entered.wait, 5)
        queued = asyncio.create_task(anext(tts.synthesize("Queued.")))
        await asyncio.sleep(0.05)
        with pytest.raises(CapacityError):
            await anext(tts.synthesize("No room."))
        runner.open()
        await asyncio.gather(busy, queued)


async def test_failing_model_raises_engine_error(g2p: EspeakG2P, voices_dir: Path) -> None:
    def broken(batch: list[Clause], deliver: Callable[[list[Clause], list[np.ndarray]], None]) -> None:
        raise RuntimeError("CUDA error: device-side assert (fake)")

    tts = KokoroTts(TtsConfig(engine="kokoro", voice="af_test", kokoro_model=str(voices_dir)),
                    runner=broken, g2p=g2p, voices=VoicePacks(str(voices_dir), voices_dir))
    await tts.start()
    try:
        with pytest.raises(EngineError, match="device-side assert"):
            async for _ in tts.synthesize("Hello there."):
                pass
        assert tts.failure_streak == 1 and tts.last_error is not None
    finally:
        await tts.aclose()


def test_factory_builds_kokoro() -> None:
    tts = create_tts(TtsConfig(engine="kokoro", voice="af_heart"), None)
    assert isinstance(tts, KokoroTts) and tts.voices() == ["af_heart"]


async def test_the_service_hears_of_batches_past_the_graphs_and_of_compiles(
    g2p: EspeakG2P, voices_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stall of the whole TTS service in a burst could be a batch run eagerly past the
    captured buckets, or a compile: the engine's figures count both since start."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    runner = FakeRunner()
    async with engine(g2p, voices_dir, runner) as tts:
        assert "graph_misses" not in tts.forward_stats() and "compiles" not in tts.forward_stats()
        tts._graph_sets = [SimpleNamespace(eager_calls=2), SimpleNamespace(eager_calls=1)]
        assert tts.forward_stats()["graph_misses"] == 3
    async with engine(g2p, voices_dir, runner, kokoro_compile=True) as tts:
        before = tts.forward_stats()["compiles"]
        monkeypatch.setitem(counters["stats"], "unique_graphs", counters["stats"]["unique_graphs"] + 2)
        assert tts.forward_stats()["compiles"] == before + 2
