"""TTS engines (Piper en_US-joe-medium and espeak-ng), real engines only.

A missing voice, espeak-ng binary or ASR model fails these tests with a message
saying what to install; nothing is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path

import jiwer
import numpy as np
import pytest

from voicebot.audio import ASR_RATE, dbfs, resample
from voicebot.config import AsrConfig, Config, TtsConfig
from voicebot.engines.contracts import Tts as TtsEngine
from voicebot.engines.registry import create_tts
from voicebot.engines.tts.text import clean_text, split_sentences
from voicebot.errors import CapacityError, EngineError, ModelError

pytestmark = pytest.mark.engines

ENGINES = ["piper", "espeak"]
SENTENCE = "The quick brown fox jumps over the lazy dog."
THREE = (
    "The weather today is sunny and warm. "
    "Tomorrow it will rain in the afternoon. "
    "Please remember to bring an umbrella."
)


@functools.cache  # resolving checks (and may build) the bundle: once per test run
def piper_voice_dir() -> str:
    try:
        from voicebot.provision import resolve_model

        return str(resolve_model("bundle:piper-en_US-joe-medium", Config().models))
    except Exception as exc:
        pytest.fail(f"Piper voice en_US-joe-medium unavailable ({exc}); run 'voicebot models pull'")


@functools.cache
def whisper_dir() -> str:
    try:
        from voicebot.provision import resolve_model

        return str(resolve_model("bundle:whisper-tiny.en", Config().models))
    except Exception as exc:
        pytest.fail(f"ASR model whisper-tiny.en unavailable ({exc}); run 'voicebot models pull'")


async def make_engine(name: str, **cfg: object) -> TtsEngine:
    if name == "espeak" and shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng binary not found: install the Debian package 'espeak-ng'")
    voice_path = piper_voice_dir() if name == "piper" else None
    engine = create_tts(TtsConfig(engine=name, **cfg), voice_path)  # type: ignore[arg-type]
    await engine.start()
    return engine


@pytest.fixture(scope="module", params=ENGINES)
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[TtsEngine]:
    eng = await make_engine(request.param, workers=1)
    yield eng
    await eng.aclose()


@pytest.fixture(scope="module")
async def asr() -> AsyncIterator[object]:
    from voicebot.engines.asr.engine import AsrEngine

    eng = AsrEngine(AsrConfig(beam_size=1), whisper_dir())
    await eng.start()
    yield eng
    await eng.aclose()


async def collect(engine: TtsEngine, text: str, **kw: object) -> list[np.ndarray]:
    async with asyncio.timeout(60):
        return [c async for c in engine.synthesize(text, **kw)]  # type: ignore[arg-type]


def child_pids() -> set[int]:
    """Live espeak-ng child processes of this process.

    Only espeak-ng: other test modules leave long-lived helpers of their own (vLLM's
    multiprocessing resource tracker) that are not this engine's business.
    """
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # thread ended meanwhile
            pids.update(int(p) for p in (task / "children").read_text().split())
    espeak = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("espeak"):
                espeak.add(pid)
    return espeak


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):  # 10 s
        if cond():
            return
        await asyncio.sleep(0.01)
    pytest.fail("condition not reached in 10 s")


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


# --- text helpers (pure) -----------------------------------------------------------


def test_clean_text_strips_markup_and_emoji() -> None:
    assert (
        clean_text("**Hi** there 🙂👍🏽 [the docs](http://x.y) `code` #tag")
        == "Hi there the docs code tag"
    )
    assert clean_text("- first item\n- second item") == "first item\nsecond item"
    assert "[" not in clean_text("say [[ h ə l oʊ ]] now")  # Piper's raw-phoneme escape
    assert clean_text("I ❤️ it 👨‍👩‍👧") == "I it"
    for empty in ("", "   \n\t", "🙂 ** ---", "...", "❤️"):
        assert clean_text(empty) == ""


def test_split_sentences() -> None:
    assert split_sentences(THREE) == [
        "The weather today is sunny and warm.",
        "Tomorrow it will rain in the afternoon.",
        "Please remember to bring an umbrella.",
    ]
    assert split_sentences("one item\nanother item") == ["one item", "another item"]


# --- both engines ------------------------------------------------------------------


async def test_sentence_is_plausible_speech(engine: TtsEngine) -> None:
    chunks = await collect(engine, SENTENCE)
    audio = np.concatenate(chunks)
    assert all(c.dtype == np.float32 and c.ndim == 1 for c in chunks)
    seconds = audio.size / engine.sample_rate
    assert engine.sample_rate == 22_050
    assert 1.5 < seconds < 6.0, f"{seconds:.2f} s for a 9-word sentence"
    assert dbfs(audio) > -30.0, f"too quiet: {dbfs(audio):.1f} dBFS"
    assert float(np.max(np.abs(audio))) <= 1.0


async def test_round_trip_through_asr(engine: TtsEngine, asr: object) -> None:
    text = "Hello, my name is Joe. I can help you book a table for dinner tonight."
    audio = np.concatenate(await collect(engine, text))
    result = await asr.transcribe(resample(audio, engine.sample_rate, ASR_RATE))  # type: ignore[attr-defined]
    wer = jiwer.wer(normalise(text), normalise(result.text))
    assert wer <= 0.20, f"WER {wer:.0%}: heard {result.text!r}"


async def test_a_list_is_spoken_without_its_numbers(engine: TtsEngine, asr: object) -> None:
    # A small model's steps: the caller hears the items, not "one. Mix the flour. two. ...".
    text = "Here are the steps:\n1. Mix the flour.\n2. Knead the dough.\n3. Bake the bread."
    audio = np.concatenate(await collect(engine, text))
    result = await asr.transcribe(resample(audio, engine.sample_rate, ASR_RATE))  # type: ignore[attr-defined]
    heard = normalise(result.text)
    assert not re.search(r"\b(one|two|three|first|second|third|[0-9]+)\b", heard), f"heard {result.text!r}"
    assert {"steps", "dough", "bread"} <= set(heard.split()), f"heard {result.text!r}"  # the items said


async def test_streams_per_sentence(engine: TtsEngine) -> None:
    pool = engine.pool  # type: ignore[attr-defined]
    done_before = pool.completed
    t0 = time.perf_counter()
    first_at, done_at_first = 0.0, 0
    chunks = 0
    async with asyncio.timeout(60):
        async for _ in engine.synthesize(THREE):
            if chunks == 0:
                first_at, done_at_first = time.perf_counter() - t0, pool.completed - done_before
            chunks += 1
    total = time.perf_counter() - t0
    assert chunks >= 2
    # The first sentence was handed over when only it had been synthesised.
    assert done_at_first == 1
    assert first_at < total


async def test_empty_and_markup_text(engine: TtsEngine) -> None:
    for text in ("", "   \n ", "🙂🙂", "** --- **"):
        assert await collect(engine, text) == []
    chunks = await collect(
        engine, "**Sure!** Here is the plan 🙂:\n- buy `milk`\n- call [Anna](tel:123)"
    )
    assert len(chunks) >= 2 and dbfs(np.concatenate(chunks)) > -30.0


async def test_speed_changes_duration(engine: TtsEngine) -> None:
    normal = sum(c.size for c in await collect(engine, SENTENCE, speed=1.0))
    fast = sum(c.size for c in await collect(engine, SENTENCE, speed=2.0))
    assert fast < 0.75 * normal


async def test_cancelled_consumers_drop_queued_work(engine: TtsEngine) -> None:
    pool = engine.pool  # type: ignore[attr-defined]
    threads_before = threading.active_count()
    dropped_before, completed_before = pool.dropped, pool.completed
    tasks: list[asyncio.Task[None]] = []
    snapshot: dict[str, int] = {}

    async def consumer() -> None:
        async for _ in engine.synthesize(THREE):
            if not snapshot:
                # One worker: the other consumers' first sentences and this one's
                # second are queued now. Cancel everybody, including ourselves.
                snapshot.update(depth=engine.queue_depth, running=pool.running)
                for t in tasks:
                    t.cancel()

    tasks.extend(asyncio.create_task(consumer()) for _ in range(4))
    async with asyncio.timeout(60):
        await asyncio.gather(*tasks, return_exceptions=True)
    assert all(t.cancelled() for t in tasks), "CancelledError was swallowed"
    assert snapshot["depth"] >= 2
    assert engine.queue_depth == 0
    assert pool.dropped - dropped_before == snapshot["depth"]
    await until(lambda: pool.running == 0)
    # Only the sentence that was delivered and the one running at cancel time ran.
    assert pool.completed - completed_before <= 1
    assert threading.active_count() <= threads_before
    await until(lambda: not child_pids())
    # And the engine still works.
    assert await collect(engine, SENTENCE)


async def test_consumer_that_stops_iterating(engine: TtsEngine) -> None:
    pool = engine.pool  # type: ignore[attr-defined]
    async with aclosing(engine.synthesize(THREE)) as stream:
        async for _ in stream:
            break
    assert engine.queue_depth == 0
    await until(lambda: pool.running == 0)
    await until(lambda: not child_pids())
    assert await collect(engine, SENTENCE)


async def test_aclose_fails_active_streams_without_cancelling_them() -> None:
    engine = await make_engine("espeak", workers=1)
    streams = [engine.synthesize(THREE) for _ in range(3)]
    firsts = [asyncio.create_task(anext(s)) for s in streams]  # type: ignore[arg-type]
    await asyncio.sleep(0)  # all three submitted: one runs, two wait
    await engine.aclose()
    results = await asyncio.gather(*firsts, return_exceptions=True)
    # Whatever had not been delivered fails with EngineError, never a CancelledError
    # that the session would mistake for its own cancellation.
    assert not any(t.cancelled() for t in firsts)
    assert any(isinstance(r, EngineError) for r in results)
    for r in results:
        assert isinstance(r, np.ndarray | EngineError)
    assert engine.queue_depth == 0 and engine.pool.running == 0  # type: ignore[attr-defined]
    assert not child_pids()
    with pytest.raises(EngineError):
        await collect(engine, SENTENCE)
    for s in streams:
        await s.aclose()  # type: ignore[attr-defined]


# --- engine specifics --------------------------------------------------------------


async def test_full_queue_raises_capacity_error() -> None:
    engine = await make_engine("espeak", workers=1, queue_size=1)
    try:
        streams = [engine.synthesize(THREE) for _ in range(3)]
        first = [asyncio.create_task(anext(s)) for s in streams]  # type: ignore[arg-type]
        results = await asyncio.gather(*first, return_exceptions=True)
        # One runs, one waits, the third finds the queue full.
        assert [type(r) for r in results].count(CapacityError) == 1
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
        assert engine.queue_depth == 0
    finally:
        await engine.aclose()


async def test_espeak_voices() -> None:
    engine = await make_engine("espeak")
    try:
        assert {"en-us", "en-gb"} <= set(engine.voices())
        assert await collect(engine, SENTENCE, voice="en-gb")
        assert await collect(engine, SENTENCE, voice="en-us+f3")
        with pytest.raises(EngineError, match="unknown espeak-ng voice"):
            await collect(engine, SENTENCE, voice="xx-nope")
    finally:
        await engine.aclose()


async def test_piper_voice_by_directory(tmp_path: Path) -> None:
    src = Path(piper_voice_dir())
    # A second voice directory (same weights under another name) exercises the cache.
    other = tmp_path / "other-voice"
    other.mkdir()
    for f in await asyncio.to_thread(lambda: list(src.glob("*.onnx*"))):
        shutil.copy(
            f, other / f.name.replace("joe", "copy")
        )  # not a symlink: it would resolve to joe
    engine = await make_engine("piper")
    try:
        assert await collect(engine, SENTENCE, voice=str(other))
        assert engine.voices() == ["en_US-joe-medium", "en_US-copy-medium"]
        assert await collect(engine, SENTENCE, voice="en_US-copy-medium")
        with pytest.raises(EngineError, match="unknown Piper voice"):
            await collect(engine, SENTENCE, voice=str(other / "missing"))
    finally:
        await engine.aclose()


def test_missing_piper_voice_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="Piper voice not found"):
        create_tts(TtsConfig(engine="piper"), str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="exactly one .onnx"):
        create_tts(TtsConfig(engine="piper"), str(tmp_path))


async def test_piper_intra_op_threads_are_configurable() -> None:
    # A many-core host runs several tts.workers: each synthesis must not take every core.
    engine = await make_engine("piper", intra_op_threads=1)
    try:
        session = engine._default.session  # type: ignore[attr-defined]
        assert session.get_session_options().intra_op_num_threads == 1
        assert await collect(engine, SENTENCE)
    finally:
        await engine.aclose()


async def test_piper_without_noise_says_a_text_the_same_way_every_time() -> None:
    # Piper samples noise for the sound and the timing of each synthesis (VITS): with the
    # voice's own settings two takes differ; with both at 0 a test's spoken input is one take.
    engine = await make_engine("piper", piper_noise_scale=0.0, piper_noise_w=0.0)
    try:
        takes = [np.concatenate([c async for c in engine.synthesize(SENTENCE)]) for _ in range(2)]
    finally:
        await engine.aclose()
    assert takes[0].size > 0 and np.array_equal(takes[0], takes[1])
