"""``asr.backend: fastconformer`` on the tiny random-weight model (tests/fastconformer_weights.py)
and real speech: streamed chunk by chunk through the slot pool, it must transcribe exactly
as the reference implementation does over the whole utterance (transformers' forward and
greedy RNN-T ``generate``, the same weights), whatever else shares its steps."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from fastconformer_weights import tiny_fastconformer_dir
from speech import Clip

from voicebot.config import AsrConfig
from voicebot.engines.asr import fastconformer_model as fm
from voicebot.engines.asr.fastconformer import FastConformerAsr
from voicebot.engines.contracts import Partial
from voicebot.engines.registry import create_asr
from voicebot.errors import CapacityError, EngineError

pytestmark = pytest.mark.engines

PIECE = 320  # samples pushed at a time (20 ms, as a call's frames arrive)


def _cfg(lookahead: int = 1, max_streams: int = 4) -> AsrConfig:
    return AsrConfig(backend="fastconformer",
                     fastconformer={"model": str(tiny_fastconformer_dir()), "lookahead_frames": lookahead,
                                    "max_streams": max_streams})


@pytest.fixture(scope="module")
def reference() -> object:
    model = fm.load_model(str(tiny_fastconformer_dir()), "cpu", "float32")
    model.generation_config.decoder_start_token_id = model.config.blank_token_id
    tokenizer = fm.load_tokenizer(str(tiny_fastconformer_dir()))

    def transcribe(audio: np.ndarray, lookahead: int) -> str:
        """The whole utterance, padded with silence to whole chunks as a stream's end is, in
        one forward and transformers' greedy decode."""
        frames = fm.frames_to_cover(audio.size, lookahead)
        padded = np.zeros((frames - 1) * fm.HOP + fm.N_FFT // 2, np.float32)
        padded[: audio.size] = audio
        feats = fm.log_mel(padded, fm.mel_filters(model.config.encoder_config.num_mel_bins))[:, :frames]
        with torch.inference_mode():
            out = model.generate(input_features=feats, num_lookahead_tokens=lookahead, max_new_tokens=100_000)
        ids = [k for k in out.sequences[0].tolist() if k != model.config.blank_token_id]
        return str(tokenizer.decode(ids, skip_special_tokens=True)).strip()

    return transcribe


async def _push_all(stream: object, audio: np.ndarray, piece: int = PIECE) -> None:
    for i in range(0, audio.size, piece):
        stream.push(audio[i : i + piece])  # type: ignore[attr-defined]
        await asyncio.sleep(0)


def test_streamed_features_are_the_whole_utterance_features(speech_clips: list[Clip]) -> None:
    audio = speech_clips[0].audio[: 3 * 16_000]
    filters = fm.mel_filters(128)
    whole = fm.log_mel(audio, filters)
    mel = fm.MelFrames(128, torch.device("cpu"), torch.float32)
    padded = np.concatenate([np.zeros(fm.N_FFT // 2, np.float32), fm.preemphasise(audio, 0.0)])
    first, per = fm.chunk_layout(1)
    got, start, n = [], 0, first
    while (start + n - 1) * fm.HOP + fm.N_FFT <= padded.size:
        got.append(mel(torch.from_numpy(padded[start * fm.HOP : start * fm.HOP + fm.samples_for(n)][None])))
        start, n = start + n, per
    streamed = torch.cat(got, 1)
    assert streamed.shape[1] > 250
    torch.testing.assert_close(streamed, whole[:, : streamed.shape[1]], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("lookahead", [0, 1, 6])
async def test_streaming_matches_the_whole_utterance_forward(speech_clips: list[Clip], reference, lookahead: int) -> None:  # type: ignore[no-untyped-def]
    async with FastConformerAsr(_cfg(lookahead), str(tiny_fastconformer_dir())) as asr:
        for clip in speech_clips[:3]:
            want = reference(clip.audio, lookahead)
            assert len(want.split()) >= 10, want  # a model that says nothing would prove nothing
            async with asr.stream() as stream:
                await _push_all(stream, clip.audio)
                final = await stream.finalize()
            assert final.text == want
            assert final.audio_s == pytest.approx(clip.duration_s)
        assert asr.stats.final_decodes == 3


async def test_partials_grow_and_are_prefixes_of_the_final(speech_clips: list[Clip]) -> None:
    clip = speech_clips[1]
    async with FastConformerAsr(_cfg(), str(tiny_fastconformer_dir())) as asr:
        stream = asr.stream()
        partials: list[Partial] = []

        async def read() -> None:
            async for p in stream:
                partials.append(p)

        reader = asyncio.create_task(read())
        for i in range(0, clip.audio.size, 1280):  # 80 ms at a time, in real time x 8
            stream.push(clip.audio[i : i + 1280])
            await asyncio.sleep(0.01)
        final = await stream.finalize()
        await stream.aclose()
        await reader
    assert len({p.text for p in partials}) >= 3, partials
    for before, after in zip(partials, partials[1:], strict=False):
        assert after.text.startswith(before.text)
        assert after.confirmed.startswith(before.confirmed)
        assert after.audio_s >= before.audio_s
    # The RNN-T never takes a token back: all the final adds is the padded last chunk's.
    assert final.text.startswith(partials[-1].text)


async def test_reset_and_a_final_at_a_pause_leave_the_stream_as_if_alone(speech_clips: list[Clip], reference) -> None:  # type: ignore[no-untyped-def]
    a, b = speech_clips[2].audio, speech_clips[3].audio
    async with FastConformerAsr(_cfg(), str(tiny_fastconformer_dir())) as asr:
        stream = asr.stream()
        await _push_all(stream, a[: a.size // 2])
        at_pause = await stream.finalize()  # a speculative final; the caller goes on
        assert at_pause.text == reference(a[: a.size // 2], 1)
        await _push_all(stream, a[a.size // 2 :])
        assert (await stream.finalize()).text == reference(a, 1)
        stream.reset()  # a new turn, in the same slot
        assert stream.buffered_s == 0
        await _push_all(stream, b)
        assert (await stream.finalize()).text == reference(b, 1)
        assert (await asr.transcribe(b)).text == reference(b, 1)
        assert (await stream.finalize()).text == reference(b, 1)  # a final keeps the utterance
        await stream.aclose()


async def test_cancelled_final_and_close_mid_stream_free_the_slot(speech_clips: list[Clip], reference) -> None:  # type: ignore[no-untyped-def]
    audio = speech_clips[4].audio
    async with FastConformerAsr(_cfg(max_streams=1), str(tiny_fastconformer_dir())) as asr:
        stream = asr.stream()
        with pytest.raises(CapacityError):
            asr.stream()
        await _push_all(stream, audio[: audio.size // 2])
        waiting = asyncio.create_task(stream.finalize())
        await asyncio.sleep(0)
        waiting.cancel()  # the turn went on: nobody waits for that final any more
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await _push_all(stream, audio[audio.size // 2 :])
        assert (await stream.finalize()).text == reference(audio, 1)  # the stream goes on unharmed

        stream.reset()
        await _push_all(stream, audio[: audio.size // 3])
        pending = asyncio.create_task(stream.finalize())
        await asyncio.sleep(0)
        await stream.aclose()  # the call ended mid-utterance, maybe mid-step
        with pytest.raises(EngineError):
            await pending
        with pytest.raises(RuntimeError):
            stream.push(audio[:PIECE])
        assert asr.free_slots == 1
        # The slot's next stream starts clean, whatever the closed one left in it.
        assert (await asr.transcribe(audio)).text == reference(audio, 1)


async def test_many_streams_joining_and_leaving_get_what_each_gets_alone(speech_clips: list[Clip]) -> None:
    rng = random.Random(7)
    n = 24
    # Each stream: a clip, a cut of it, when it joins (in pieces of the shared clock).
    plans = []
    for i in range(n):
        clip = speech_clips[i % len(speech_clips)].audio
        start = rng.randrange(0, clip.size // 3)
        plans.append((clip[start : start + rng.randrange(16_000, 3 * 16_000)], rng.randrange(0, 120)))
    async with FastConformerAsr(_cfg(max_streams=n), str(tiny_fastconformer_dir())) as asr:
        alone = [(await asr.transcribe(audio)).text for audio, _ in plans]
        assert sum(len(t.split()) for t in alone) > 3 * n

        steps: list[int] = []
        step = asr.pool.step

        def counted(rows: list[fm.Row]) -> list[list[int]]:
            steps.append(len(rows))
            return step(rows)

        asr.pool.step = counted  # type: ignore[method-assign]

        async def call(audio: np.ndarray, join: int) -> str:
            await asyncio.sleep(join * 0.005)
            async with asr.stream() as stream:
                for i in range(0, audio.size, 640):
                    stream.push(audio[i : i + 640])
                    await asyncio.sleep(0.005)
                return (await stream.finalize()).text

        together = await asyncio.gather(*(call(audio, join) for audio, join in plans))
        assert asr.free_slots == n
    assert together == alone
    # Streams at different points shared steps. How many meet in one step depends on the
    # machine's load (paced by real sleeps): 11-12 of 24 here, so the bound keeps a margin.
    assert max(steps) >= n // 4, steps


async def test_the_registry_builds_it_and_a_stopped_engine_refuses_streams(speech_clips: list[Clip]) -> None:
    cfg = _cfg()
    asr = create_asr(cfg, str(tiny_fastconformer_dir()))
    assert isinstance(asr, FastConformerAsr)
    with pytest.raises(EngineError):
        asr.stream()
    async with asr:
        assert (await asr.transcribe(np.zeros(0, np.float32))).text == ""
    with pytest.raises(EngineError):
        asr.stream()


def _rows(audio: np.ndarray, lookahead: int, rng: random.Random) -> list[fm.Row]:
    """A stream's rows as the engine takes them (slot 0; the schedule sets it): its chunks,
    kept, with now and then a speculative final's padded chunk, not kept, and the last."""
    first_mel, next_mel = fm.chunk_layout(lookahead)
    pending = np.concatenate([np.zeros(fm.N_FFT // 2, np.float32), fm.preemphasise(audio, 0.0)])
    rows, first = [], True
    while True:
        frames = first_mel if first else next_mel
        need = fm.samples_for(frames)
        if rng.random() < 0.2 or pending.size < need:
            tail = np.zeros(need, np.float32)
            tail[: min(need, pending.size)] = pending[:need]
            rows.append(fm.Row(0, tail, first, keep=False))
            if pending.size < need:
                return rows
        rows.append(fm.Row(0, pending[:need].copy(), first))
        pending, first = pending[frames * fm.HOP :], False


def _run(pool: fm.SlotPool, streams: list[tuple[list[fm.Row], int]]) -> tuple[list[list[list[int]]], list[int]]:
    """Each stream's rows through ``pool``, one a step, from its join step on, as slots free
    up (a closed stream's slot goes to the next one, which starts afresh): each row's tokens,
    and the row count of every step."""
    free = list(range(pool.slots - 1, -1, -1))
    active: dict[int, tuple[int, int]] = {}  # stream -> (slot, next row)
    waiting = list(range(len(streams)))
    tokens: list[list[list[int]]] = [[] for _ in streams]
    sizes: list[int] = []
    clock = 0
    while waiting or active:
        for i in [i for i in waiting if streams[i][1] <= clock]:
            if free:
                active[i] = (free.pop(), 0)
                waiting.remove(i)
        batch = [(i, streams[i][0][k]) for i, (_, k) in active.items()]
        if batch:
            rows = [fm.Row(active[i][0], r.samples, r.first, r.keep) for i, r in batch]
            sizes.append(len(rows))
            for (i, _), ids in zip(batch, pool.step(rows), strict=True):
                tokens[i].append(ids)
                slot, k = active[i]
                if k + 1 == len(streams[i][0]):
                    free.append(active.pop(i)[0])
                else:
                    active[i] = (slot, k + 1)
        clock += 1
    return tokens, sizes


def test_a_step_padded_to_fixed_row_counts_gives_each_stream_what_it_gets_alone(speech_clips: list[Clip]) -> None:
    """The fixed-shape step (what CUDA graphs capture): rows padded to a bucket, first chunks
    in the steady shape beside steady ones, finals' chunks that keep no state, slots reused,
    streams joining at different times: every row's tokens are those of the stream alone."""
    model = fm.load_model(str(tiny_fastconformer_dir()), "cpu", "float32")
    rng = random.Random(11)
    streams = []
    for i in range(20):
        clip = speech_clips[i % len(speech_clips)].audio
        start = rng.randrange(0, clip.size // 3)
        streams.append((_rows(clip[start : start + rng.randrange(8_000, 40_000)], 1, rng), rng.randrange(0, 40)))
    pool = fm.SlotPool(model, 8, 1, buckets=fm.step_buckets(8))
    together, sizes = _run(pool, streams)
    alone = [_run(fm.SlotPool(model, 1, 1), [(rows, 0)])[0][0] for rows, _ in streams]
    assert together == alone
    assert sum(len(ids) for rows in alone for ids in rows) > 200  # the streams say something
    assert {5, 7} & set(sizes) and max(sizes) == 8, sizes  # padded steps, and full ones
    assert any(not r.keep for rows, _ in streams for r in rows[1:-1])


def test_cuda_graphs_need_a_cuda_device() -> None:
    model, _ = fm.random_model(tiny=True)
    with pytest.raises(ValueError, match="CUDA"):
        fm.SlotPool(model, 4, 1, cuda_graphs=True)
