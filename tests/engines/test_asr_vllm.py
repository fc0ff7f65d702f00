"""The vLLM Whisper backend's engine logic, with a fake of our own ``WhisperRunner``.

The runner is the seam between :class:`VllmAsrEngine` and vLLM; the fake scripts what
a Whisper decode returns (one word per half second of audio, continuing the forced
prefix) and can hold a decode open, so ordering, cancellation and closing are tested
without a GPU. The real runner is measured on a GPU by benchmarks/gpu_asr.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_whisper import WAIT, WORDS, FakeWhisper, audio

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig, load_config
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.asr.vllm_whisper import (
    WHISPER_MAX_TARGET_TOKENS,
    VllmAsrEngine,
    WhisperVllmSettings,
)
from voicebot.engines.registry import create_asr
from voicebot.errors import EngineError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def engine(fake: FakeWhisper, concurrency: int = 4, **cfg: object) -> VllmAsrEngine:
    settings = WhisperVllmSettings(concurrency=concurrency)
    fields: dict[str, object] = {"backend": "vllm", "partial_interval_ms": 500, "agreement_n": 2, **cfg}
    asr_cfg = AsrConfig(**fields)  # type: ignore[arg-type]
    return VllmAsrEngine(asr_cfg, "fake-whisper", agreement_n=2, settings=settings, runner=fake)


async def test_partials_force_the_confirmed_words_and_the_final_decodes_without_them() -> None:
    fake = FakeWhisper()
    async with engine(fake) as eng:
        stream = eng.stream()
        partials = []
        for _ in range(4):  # 4 x 0.5 s: one partial each
            stream.push(audio(0.5))
            partials.append(await asyncio.wait_for(anext(stream), WAIT))
        assert partials[-1].text == "alpha bravo charlie delta"
        confirmed = partials[-1].confirmed
        assert confirmed.startswith("alpha bravo")  # two agreeing hypotheses
        # The last partial's decoder prompt carried the words confirmed before it.
        assert fake.calls[-1]["prompt"] == [1, 2, 3, 4] + [100 + WORDS.index(w) for w in ("alpha", "bravo")]
        final = await asyncio.wait_for(stream.finalize(), WAIT)
        # The final's did not: it decodes the whole audio as a one-shot transcribe does.
        last = fake.calls[-1]
        assert last["prompt"] == [1, 2, 3, 4]
        assert last["priority"] == 0
        assert all(c["priority"] == 1 for c in fake.calls[:-1])
        assert final.text == "alpha bravo charlie delta"
        assert final.audio_s == pytest.approx(2.0)
        await stream.aclose()


async def test_only_a_partial_decoded_as_the_final_is_reused_as_the_final() -> None:
    fake = FakeWhisper()
    async with engine(fake) as eng:
        stream = eng.stream()
        for _ in range(4):
            stream.push(audio(0.5))
            await asyncio.wait_for(anext(stream), WAIT)
        assert stream.confirmed == "alpha bravo charlie"
        # The last interval partial saw the end of speech (2 s) but had words forced: it
        # cannot be the final, which decodes without them.
        calls = len(fake.calls)
        final = await asyncio.wait_for(stream.finalize(covering_s=2.0), WAIT)
        assert final.decode_s > 0 and len(fake.calls) == calls + 1
        assert fake.calls[-1]["prompt"] == [1, 2, 3, 4]
        # The partial asked for at the end of speech is decoded as the final is, and is it.
        stream.push(audio(0.2))
        stream.request_partial(covering_s=2.2)
        partial = await asyncio.wait_for(anext(stream), WAIT)
        assert fake.calls[-1]["prompt"] == [1, 2, 3, 4] and fake.calls[-1]["priority"] == 1
        assert partial.confirmed.startswith("alpha bravo charlie")
        calls = len(fake.calls)
        final = await asyncio.wait_for(stream.finalize(covering_s=2.2), WAIT)
        assert final.decode_s == 0.0 and len(fake.calls) == calls
        assert final.text == "alpha bravo charlie delta"
        # A pause is not the end: the next interval partial forces the confirmed words again.
        stream.push(audio(0.5))
        await asyncio.wait_for(anext(stream), WAIT)
        assert fake.calls[-1]["prompt"] == [1, 2, 3, 4] + [100 + WORDS.index(w) for w in ("alpha", "bravo", "charlie")]
        await stream.aclose()


async def test_once_the_head_audio_is_dropped_the_final_keeps_the_confirmed_words_forced() -> None:
    fake = FakeWhisper()
    async with engine(fake, max_utterance_s=2.0) as eng:
        stream = eng.stream()
        for _ in range(4):
            stream.push(audio(0.5))
            await asyncio.wait_for(anext(stream), WAIT)
        await asyncio.wait_for(stream.finalize(), WAIT)
        assert fake.calls[-1]["prompt"] == [1, 2, 3, 4]  # 2 s buffered: nothing dropped yet
        confirmed = stream.confirmed
        stream.push(audio(0.5))  # over max_utterance_s: the first 0.5 s is gone
        await asyncio.wait_for(anext(stream), WAIT)
        assert stream.buffered_s == pytest.approx(2.0)
        await asyncio.wait_for(stream.finalize(), WAIT)
        # Words heard only in the dropped audio can come from nowhere else: forced.
        assert fake.calls[-1]["prompt"][4:] == [100 + WORDS.index(w) for w in stream.confirmed.split()]
        assert stream.confirmed.startswith(confirmed) and confirmed
        await stream.aclose()


async def test_final_goes_before_queued_partials_of_other_streams() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    async with engine(fake, concurrency=1, partial_interval_ms=500) as eng:
        busy, *others = [eng.stream() for _ in range(4)]
        busy.push(audio(0.5))  # its partial takes the only slot and is held
        await asyncio.wait_for(fake.started.wait(), WAIT)
        for s in others:
            s.push(audio(0.5))  # three partials queue behind it
        final_stream = others[-1]
        final = asyncio.create_task(final_stream.finalize())
        await asyncio.sleep(0.01)
        fake.hold.set()
        await asyncio.wait_for(final, WAIT)
        # Order of decodes: the held partial, then the final, then the other partials.
        kinds = [c["priority"] for c in fake.calls]
        assert kinds[:2] == [1, 0], kinds
        for s in (busy, *others):
            await s.aclose()


async def test_cancelling_a_running_final_aborts_its_request_and_reraises() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    async with engine(fake) as eng:
        stream = eng.stream()
        stream._chunks.append(audio(1.0))  # audio without scheduling a partial
        stream._samples = ASR_RATE
        task = asyncio.create_task(stream.finalize())
        await asyncio.wait_for(fake.started.wait(), WAIT)
        rid = fake.calls[-1]["rid"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(10):
            await asyncio.sleep(0)
        assert fake.aborted == [rid]
        assert eng.in_flight == 0
        # The engine goes on serving: the slot is free again.
        fake.hold.set()
        text = await asyncio.wait_for(stream.finalize(), WAIT)
        assert text.text == "alpha bravo"
        await stream.aclose()


async def test_closing_the_engine_aborts_decodes_and_fails_waiting_finals() -> None:
    fake = FakeWhisper()
    fake.hold = asyncio.Event()
    eng = engine(fake, concurrency=1)
    await eng.start()
    s1, s2 = eng.stream(), eng.stream()
    for s in (s1, s2):
        s._chunks.append(audio(1.0))
        s._samples = ASR_RATE
    running = asyncio.create_task(s1.finalize())
    await asyncio.wait_for(fake.started.wait(), WAIT)
    queued = asyncio.create_task(s2.finalize())
    await asyncio.sleep(0.01)
    await eng.aclose()
    for task in (running, queued):
        with pytest.raises(EngineError):
            await asyncio.wait_for(task, WAIT)
    assert len(fake.aborted) == 1 and fake.closed
    assert len(fake.calls) == 1  # the queued final never reached the runner


async def test_a_partial_from_before_the_end_of_speech_is_aborted_not_awaited_by_the_final() -> None:
    # finalize() waited for a running partial that had not heard the end of speech, then
    # decoded; the partial is useless to the final: its request is aborted instead.
    fake = FakeWhisper()
    fake.hold = asyncio.Event()  # never set: only the partial that started early waits on it
    async with engine(fake) as eng:
        stream = eng.stream()
        stream.push(audio(0.5))  # a partial starts on the first 0.5 s ...
        await asyncio.wait_for(fake.started.wait(), WAIT)
        fake.hold = None  # ... and is held; later decodes are not
        stream.push(audio(0.5))  # the caller speaks on and ends at 1.0 s
        final = await asyncio.wait_for(stream.finalize(covering_s=1.0), WAIT)
        assert final.text == "alpha bravo" and final.audio_s == pytest.approx(1.0)
        assert fake.aborted == [fake.calls[0]["rid"]]
        assert [c["priority"] for c in fake.calls] == [1, 0]  # the final decoded as a final
        assert eng.stats.abandoned_partials == 1 and eng.in_flight == 0
        assert stream._partial_job is None
        await stream.aclose()


class SlowAbortWhisper(FakeWhisper):
    """The real runner awaits vLLM's ``abort`` when its request is cancelled: held here."""

    def __init__(self) -> None:
        super().__init__()
        self.aborting = asyncio.Event()  # a cancelled decode is aborting its request
        self.abort_done = asyncio.Event()  # never set: the abort takes as long as the test

    async def decode(self, request_id: str, audio: np.ndarray, prompt_ids: list[int], **kw: int) -> str:
        try:
            return await super().decode(request_id, audio, prompt_ids, **kw)
        except asyncio.CancelledError:
            self.aborting.set()
            await self.abort_done.wait()
            raise


async def test_closing_the_engine_while_a_superseded_partial_aborts_ends_its_decode_slot() -> None:
    # The slot's task, cancelled by aclose() while it waited for the superseded partial's
    # abort, swallowed the cancellation (unless_abandoned) and went on waiting for work:
    # aclose() never returned.
    fake = SlowAbortWhisper()
    fake.hold = asyncio.Event()
    eng = engine(fake, concurrency=1)
    await eng.start()
    stream = eng.stream()
    stream.push(audio(0.5))  # a partial starts on the first 0.5 s and is held ...
    await asyncio.wait_for(fake.started.wait(), WAIT)
    stream.push(audio(0.5))  # ... the caller speaks on to 1.0 s
    final = asyncio.create_task(stream.finalize(covering_s=1.0))  # the partial is superseded
    await asyncio.wait_for(fake.aborting.wait(), WAIT)  # its request is being aborted
    slots = list(eng._workers)
    await asyncio.wait_for(eng.aclose(), WAIT)
    assert all(task.done() for task in slots)
    with pytest.raises(EngineError):
        await asyncio.wait_for(final, WAIT)
    await stream.aclose()


async def test_a_failed_decode_fails_only_its_final() -> None:
    fake = FakeWhisper()

    async def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("CUDA error: out of memory")

    async with engine(fake) as eng:
        stream = eng.stream()
        stream._chunks.append(audio(1.0))
        stream._samples = ASR_RATE
        fake.decode = broken  # type: ignore[method-assign]
        with pytest.raises(EngineError, match="out of memory"):
            await asyncio.wait_for(stream.finalize(), WAIT)
        assert eng.stats.failed_decodes == 1
        fake.decode = FakeWhisper.decode.__get__(fake)  # type: ignore[method-assign]
        assert (await asyncio.wait_for(stream.finalize(), WAIT)).text == "alpha bravo"
        await stream.aclose()


def test_token_budget_is_bounded_by_audio_length_and_whisper_window() -> None:
    eng = engine(FakeWhisper())
    from voicebot.engines.asr.jobs import DecodeJob, Priority

    short = DecodeJob(Priority.FINAL, None, audio=audio(2.0))
    assert eng.token_budget(short, 4) == (0, 2 * 8 + 16)
    long = DecodeJob(Priority.FINAL, None, audio=audio(30.0))
    assert eng.token_budget(long, 40) == (0, 30 * 8 + 16)
    assert eng.token_budget(long, 300) == (0, WHISPER_MAX_TARGET_TOKENS - 300 - 1)
    with pytest.raises(EngineError):
        eng.token_budget(long, WHISPER_MAX_TARGET_TOKENS)


def test_backend_is_chosen_by_config_and_defaults_to_faster_whisper() -> None:
    assert AsrConfig().backend == "faster-whisper"
    assert type(create_asr(AsrConfig(), "m")) is AsrEngine
    assert isinstance(create_asr(AsrConfig(backend="vllm"), "m"), VllmAsrEngine)
    cfg = load_config(None, ["asr.backend=vllm"])
    assert cfg.asr.backend == "vllm"
    with pytest.raises(Exception, match="backend"):
        load_config(None, ["asr.backend=whisper.cpp"])


def test_importing_the_backend_does_not_import_vllm() -> None:
    code = "import sys, voicebot.engines.asr.vllm_whisper; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------- asr.vllm: the engine's sizing
def test_asr_vllm_settings_reach_the_engine() -> None:
    # They were dataclass defaults only: `voicebot asr-serve` ran Whisper at 10% of the GPU and
    # 8 encoder windows per step whatever a profile said (the benchmarks patched them in).
    cfg = load_config(None, ["asr.backend=vllm", "asr.vllm.gpu_memory_utilization=0.2",
                             "asr.vllm.max_num_batched_tokens=48000", "asr.vllm.concurrency=64",
                             "asr.vllm.feature_workers=8", "asr.vllm.load_format=dummy"])
    eng = create_asr(cfg.asr, "m")
    assert isinstance(eng, VllmAsrEngine)
    s = eng.settings
    assert (s.gpu_memory_utilization, s.max_num_batched_tokens, s.concurrency, s.feature_workers, s.load_format) == (
        0.2, 48000, 64, 8, "dummy")


def test_asr_vllm_defaults_are_the_engines_and_bad_values_are_refused() -> None:
    from voicebot.config import WhisperVllmConfig

    assert WhisperVllmSettings(**WhisperVllmConfig().model_dump()) == WhisperVllmSettings()
    for bad in ("asr.vllm.max_num_batched_tokens=1000",  # less than one 30 s window (1500)
                "asr.vllm.gpu_memory_utilization=0", "asr.vllm.load_format=fast", "asr.vllm.concurency=4"):
        with pytest.raises(Exception, match="vllm"):
            load_config(None, [bad])


def test_gpu_profiles_size_whisper_as_measured_and_fit_beside_the_llm() -> None:
    # configs/gpu-asr-service.yaml: the service's engine as docs/gpu-results.md measured it.
    svc = load_config(CONFIGS / "gpu-asr-service.yaml").asr
    s = create_asr(svc.model_copy(update={"backend": svc.remote.engine}), "m").settings  # as asr-serve does
    assert (s.gpu_memory_utilization, s.max_num_batched_tokens, s.feature_workers) == (0.15, 48000, 8)
    # configs/gpu.yaml: Whisper and the LLM are two vLLM engines on one GPU; each takes its share
    # of the whole memory, and CUDA contexts need the rest.
    one = load_config(CONFIGS / "gpu.yaml")
    assert one.asr.backend == "vllm"
    assert one.llm.gpu_memory_utilization + one.asr.vllm.gpu_memory_utilization <= 0.9
