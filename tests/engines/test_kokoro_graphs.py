"""Kokoro's bucketed encode and decode (voicebot/engines/tts/kokoro_graphs.py) on a CPU:
the bucket-padded functions that CUDA graphs capture, run eagerly, against each clause
encoded and decoded alone and unpadded; and the settings that refuse CUDA graphs without
a CUDA device."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from kokoro_small import small_model, zero_noise
from pydantic import ValidationError

from voicebot.config import TtsConfig
from voicebot.engines.tts import kokoro_graphs as kg
from voicebot.engines.tts import kokoro_model as km
from voicebot.engines.tts.kokoro_graphs import BucketedDecoder, BucketedEncoder, buckets

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast


@pytest.fixture(scope="module")
def model() -> Any:
    return small_model()


@pytest.fixture
def no_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    zero_noise(monkeypatch)


def test_buckets_are_powers_of_two_and_halfway_points() -> None:
    assert buckets(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    assert buckets(600, 16) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768]


def test_shape_pads_to_the_next_bucket_within_max_frames(model: Any) -> None:
    dec = BucketedDecoder(model, max_frames=4096)
    assert dec.shape(1, 10) == (1, 16)
    assert dec.shape(5, 70) == (6, 96)
    assert dec.shape(40, 200) is None  # 48 x 256 padded frames: beyond max_frames, run unpadded


def test_each_thread_learns_how_long_it_waited_for_the_decoders_lock(model: Any) -> None:
    import threading
    import time

    dec = BucketedDecoder(model)
    got: list[float] = []

    def wait_for_the_graphs() -> None:
        with dec.graphs.locked():
            pass
        got.append(dec.take_lock_wait())

    held = dec.graphs.locked()
    held.__enter__()  # another forward holds the graphs
    waiter = threading.Thread(target=wait_for_the_graphs)
    waiter.start()
    time.sleep(0.1)
    held.__exit__(None, None, None)
    waiter.join(5)
    assert got and got[0] >= 0.09
    assert dec.take_lock_wait() < 0.05  # this thread took it at once
    assert dec.take_lock_wait() == 0.0  # asked again: nothing since


def test_bucket_padding_gives_each_clause_its_own_audio(model: Any, no_noise: None) -> None:
    """Five clauses padded to 6 rows x 48 frames (a padded row, frames past each end),
    then one alone padded to 1 x 24: each as decoded alone, unpadded, but for the very
    end of the utterance (kokoro_model: the source's interpolation and STFT reach past it)."""
    ids = [[50, 83, 54, 156, 57, 16, 65, 85, 54, 46], [44, 102, 56], [61, 62, 69, 158, 123, 62, 16, 86, 56, 46, 4]]
    durations = [[3, 2, 4, 3, 3, 2, 4, 3, 2, 3], [2, 3, 4], [3] * 11]
    styles = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * 0.15
    dec = BucketedDecoder(model)
    with torch.inference_mode():
        batch = km.encode(model, ids, styles, [1.0] * 3, durations)
        items = [*batch, *batch[:2]]
        assert dec.shape(5, max(e.frames for e in batch)) == (6, 48)
        padded = dec.decode(items)
        alone_padded = dec.decode(batch[1:2])
        for i, got in enumerate([*padded, *alone_padded]):
            row = i % 3 if i < 5 else 1
            one = km.encode(model, [ids[row]], styles[row : row + 1], [1.0], [durations[row]])
            ref = km.decode(model, one)[0].numpy()
            got_np = got.numpy()
            assert got_np.shape == ref.shape == (one[0].frames * km.SAMPLES_PER_FRAME,)
            peak = np.abs(ref).max() + 1e-9
            body = slice(km.SAMPLES_PER_FRAME, len(ref) - 2 * km.SAMPLES_PER_FRAME)
            assert np.abs(got_np[body] - ref[body]).max() / peak < 1e-4, i
            assert np.abs(got_np - ref).max() / peak < 0.1, i
    assert dec.eager_calls == 0 and dec.captures == 0


def test_cuda_graphs_are_refused_without_a_cuda_device(model: Any) -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        BucketedDecoder(model, cuda_graphs=True)
    with pytest.raises(ValidationError, match="kokoro_cuda_graphs needs a CUDA device"):
        TtsConfig(engine="kokoro", device="cpu", kokoro_cuda_graphs=True)


def test_warm_up_runs_every_bucket_up_to_a_batch_of_clauses_once(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a service runs before it takes calls (with CUDA graphs: each bucket captured)."""
    seen: list[tuple[int, int, bool]] = []
    real = km.decode_rows

    def counting(mdl: Any, en: torch.Tensor, asr: torch.Tensor, styles: torch.Tensor, frames: torch.Tensor,
                 *, masked: bool) -> torch.Tensor:
        seen.append((en.shape[0], en.shape[2], masked))
        assert asr.shape[:1] == styles.shape[:1] == frames.shape == en.shape[:1]
        return real(mdl, en, asr, styles, frames, masked=masked)

    monkeypatch.setattr(km, "decode_rows", counting)
    shapes = BucketedDecoder(model).warm_up(max_rows=3, max_frames=24)
    assert shapes == [(1, 16), (1, 24), (2, 16), (2, 24), (3, 16), (3, 24)]
    assert seen == [(r, f, True) for r, f in shapes]
    # A batch's largest group pads to a bucket that is warm.
    assert BucketedDecoder(model).shape(3, 20) in shapes


def test_warm_up_of_a_compiled_model_runs_each_kind_of_decode(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row; several of one length; several of their own lengths (masked): Dynamo's kinds."""
    seen: list[tuple[int, bool, list[int]]] = []
    real = km.decode_rows

    def counting(mdl: Any, en: torch.Tensor, asr: torch.Tensor, styles: torch.Tensor, frames: torch.Tensor,
                 *, masked: bool) -> torch.Tensor:
        seen.append((en.shape[0], masked, frames.tolist()))
        return real(mdl, en, asr, styles, frames, masked=masked)

    monkeypatch.setattr(km, "decode_rows", counting)
    km.warm_up_compiled(model)
    assert seen == [(1, False, [16]), (2, False, [16, 16]), (2, True, [16, 15])]


_IDS = [[50, 83, 54, 156, 57, 16, 65, 85, 54, 46], [44, 102, 56], [61, 62, 69, 158, 123, 62, 16, 86, 56, 46, 4],
        [50, 83], [44, 102, 56, 57, 16]]
_DURATIONS = [[3, 2, 4, 3, 3, 2, 4, 3, 2, 3], [2, 3, 4], [3] * 11, [2, 2], [3, 2, 3, 2, 3]]


@pytest.mark.parametrize("forced", [True, False], ids=["forced-durations", "predicted-durations"])
def test_bucket_padding_gives_each_clause_its_own_encoding(model: Any, forced: bool) -> None:
    """Five clauses padded to 6 rows x 16 phonemes (a padded row, phonemes past each end):
    each row's features and frame count as the clause encoded alone, unpadded."""
    styles = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)) * 0.15
    speeds = [1.0, 1.2, 0.9, 1.0, 1.1]
    durations = _DURATIONS if forced else None
    enc = BucketedEncoder(model)
    assert enc.shape(5, max(len(i) for i in _IDS) + 2) == (6, 16)
    with torch.inference_mode():
        got = enc.encode(_IDS, styles, speeds, durations)
        for row, item in enumerate(got):
            one = km.encode(model, [_IDS[row]], styles[row : row + 1], [speeds[row]],
                            None if durations is None else [durations[row]])[0]
            assert item.frames == one.frames, row
            for name in ("en", "asr"):
                ref, mine = getattr(one, name), getattr(item, name)
                assert mine.shape == ref.shape, (row, name)
                assert (mine - ref).abs().max() / ref.abs().max() < 1e-4, (row, name)
    assert enc.eager_calls == 0


def test_an_encode_beyond_the_buckets_runs_unpadded(model: Any) -> None:
    enc = BucketedEncoder(model, max_tokens=16)
    long = [list(range(10, 40))]  # 32 phonemes with the boundaries: past the last bucket
    with torch.inference_mode():
        got = enc.encode(long, torch.zeros(1, 256), [1.0], [[2] * 30])
    assert enc.eager_calls == 1 and got[0].frames == 62


def test_a_batch_past_the_warmed_buckets_is_counted_and_named_in_the_log(model: Any, caplog: Any) -> None:
    """After the warm-up every eager batch is one no capture covers: the TTS service reports
    the count (graph_misses) and the log names the first few, with their shape."""
    enc = BucketedEncoder(model, max_tokens=16)
    enc.warm_up(1, 16, forced=True)
    caplog.set_level(logging.WARNING, logger="voicebot.engines.tts.kokoro_graphs")
    with torch.inference_mode():
        for _ in range(kg.MISSES_LOGGED + 2):
            enc.encode([list(range(10, 40))], torch.zeros(1, 256), [1.0], [[2] * 30])
    assert enc.eager_calls == kg.MISSES_LOGGED + 2
    named = [r.getMessage() for r in caplog.records if "past the captured buckets" in r.getMessage()]
    assert len(named) == kg.MISSES_LOGGED and "encode batch of 1 rows x 32" in named[0]


def test_encode_warm_up_runs_every_bucket_once(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, bool]] = []
    real = km.encode_tokens

    def counting(mdl: Any, ids: torch.Tensor, lengths: torch.Tensor, styles: torch.Tensor,
                 speeds: torch.Tensor | None, forced: torch.Tensor | None, *, ragged: bool) -> Any:
        seen.append((*ids.shape, forced is not None))
        assert lengths.shape == styles.shape[:1] == ids.shape[:1] and ragged
        return real(mdl, ids, lengths, styles, speeds, forced, ragged=ragged)

    monkeypatch.setattr(km, "encode_tokens", counting)
    enc = BucketedEncoder(model, max_cells=48)
    shapes = enc.warm_up(max_rows=4, max_tokens=20, forced=True)
    assert shapes == [(1, 16), (1, 24), (2, 16), (2, 24), (3, 16)]  # 3 x 24 and 4 x 16 are over 48 cells
    assert seen == [(r, t, True) for r, t in shapes]
    assert enc.shape(3, 20) is None  # run as it is


def test_one_clause_padded_past_its_length_is_masked(model: Any) -> None:
    """One row padded to 16 phonemes (no padded row, every row of one length): its padding
    is still masked, so it encodes as it does unpadded."""
    styles = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)) * 0.15
    with torch.inference_mode():
        tb = km.tokens(torch.device("cpu"), _IDS[1:2], _DURATIONS[1:2], t=16)
        assert tb.ragged
        d, t_en, cum = km.encode_tokens(model, tb.ids, tb.lengths, styles, None, tb.forced, ragged=tb.ragged)
        got = km.align(d, t_en, cum, styles, tb.frames)[0]
        ref = km.encode(model, _IDS[1:2], styles, [1.0], _DURATIONS[1:2])[0]
    assert got.frames == ref.frames
    assert (got.en - ref.en).abs().max() / ref.en.abs().max() < 1e-4


def _as_on_a_gpu(stage: Any, monkeypatch: pytest.MonkeyPatch, replay: Any) -> list[Any]:
    """``stage`` with CUDA graphs on, its replays (a capture on a key's first use) by ``replay``."""
    stage.cuda_graphs = True
    keys: list[Any] = []

    def recorded(key: Any, fn: Any, *inputs: torch.Tensor) -> Any:
        keys.append(key)
        return replay(key, fn, *inputs)

    monkeypatch.setattr(stage.graphs, "replay", recorded)
    return keys


def _capture(graphs: Any) -> Any:
    def capture(key: Any, fn: Any, *inputs: torch.Tensor) -> Any:
        graphs.graphs[key] = fn  # stands in for the captured graph
        return fn(*inputs)

    return capture


def test_an_encode_that_cannot_be_captured_runs_eagerly_and_unpadded_from_then_on(
    model: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    enc = BucketedEncoder(model)

    def refuse(key: Any, fn: Any, *inputs: torch.Tensor) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    keys = _as_on_a_gpu(enc, monkeypatch, refuse)
    styles = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)) * 0.15
    with torch.inference_mode(), caplog.at_level("WARNING"):
        got = enc.encode(_IDS[:2], styles, [1.0, 1.0], _DURATIONS[:2])
        again = enc.encode(_IDS[:2], styles, [1.0, 1.0], _DURATIONS[:2])
        ref = km.encode(model, _IDS[:2], styles, [1.0, 1.0], _DURATIONS[:2])
    assert keys == [(2, 16, True)] and not enc.cuda_graphs  # tried once
    assert enc.eager_calls == 1  # the second, as km.encode: unpadded
    assert "cannot be captured" in caplog.text and "operation not permitted" in caplog.text
    for a, b, r in zip(got, again, ref, strict=True):
        assert a.frames == b.frames == r.frames
        assert (a.en - r.en).abs().max() < 1e-4 and (b.asr - r.asr).abs().max() < 1e-4


def test_an_encode_that_fails_eagerly_too_raises_and_keeps_its_graphs(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capture was not at fault: the error is the caller's, and graphs stay on."""
    enc = BucketedEncoder(model)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(km, "encode_tokens", broken)
    _as_on_a_gpu(enc, monkeypatch, lambda key, fn, *inputs: fn(*inputs))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="out of memory"):
        enc.encode(_IDS[:2], torch.zeros(2, 256), [1.0, 1.0], _DURATIONS[:2])
    assert enc.cuda_graphs and enc.pad


def test_a_replay_that_fails_raises(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    enc = BucketedEncoder(model)
    state = {"replays": 0}

    def capture_then_fail(key: Any, fn: Any, *inputs: torch.Tensor) -> Any:
        state["replays"] += 1
        if key in enc.graphs.graphs:
            raise RuntimeError("an illegal memory access was encountered")
        return _capture(enc.graphs)(key, fn, *inputs)

    _as_on_a_gpu(enc, monkeypatch, capture_then_fail)
    with torch.inference_mode():
        enc.encode(_IDS[:2], torch.zeros(2, 256), [1.0, 1.0], _DURATIONS[:2])
        with pytest.raises(RuntimeError, match="illegal memory access"):
            enc.encode(_IDS[:2], torch.zeros(2, 256), [1.0, 1.0], _DURATIONS[:2])
    assert state["replays"] == 2 and enc.cuda_graphs


def test_after_warm_up_a_bucket_it_did_not_reach_runs_eagerly(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is captured once the service takes calls (module docstring: a capture and
    another thread's random draw cannot overlap)."""
    enc, dec = BucketedEncoder(model), BucketedDecoder(model)
    enc_keys = _as_on_a_gpu(enc, monkeypatch, _capture(enc.graphs))
    dec_keys = _as_on_a_gpu(dec, monkeypatch, _capture(dec.graphs))
    with torch.inference_mode():
        assert enc.warm_up(max_rows=2, max_tokens=16, forced=True) == [(1, 16), (2, 16)]
        assert dec.warm_up(max_rows=1, max_frames=16) == [(1, 16)]
        warm = enc.encode(_IDS[:2], torch.zeros(2, 256), [1.0, 1.0], _DURATIONS[:2])  # 2 x 16: warm
        cold = enc.encode(_IDS[:3], torch.zeros(3, 256), [1.0] * 3, _DURATIONS[:3])  # 3 x 16: not
        dec.decode(km.encode(model, _IDS[3:4], torch.zeros(1, 256), [1.0], _DURATIONS[3:4]))  # 1 x 16: warm
        dec.decode(warm)  # 2 x 24 frames: not
    assert enc_keys == [(1, 16, True), (2, 16, True), (2, 16, True)] and enc.eager_calls == 1
    assert dec_keys == [(1, 16), (1, 16)] and dec.eager_calls == 1
    assert len(cold) == 3
