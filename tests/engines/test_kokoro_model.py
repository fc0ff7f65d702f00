"""The batched Kokoro forward (voicebot/engines/tts/kokoro_model.py) against batch 1.

On the ``kokoro`` package's own modules with random weights of a small shape (the real
one is 82 M parameters; the code path is the same). The vocoder's noise source is zeroed
so that two runs can be compared sample by sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from kokoro_small import small_model, zero_noise

from voicebot.engines.tts import kokoro_model as km

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast


@pytest.fixture(scope="module")
def model() -> Any:
    return small_model()


@pytest.fixture
def no_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    zero_noise(monkeypatch)


def test_real_shape_has_82m_parameters() -> None:
    torch.manual_seed(0)
    full = km.build_model(km.random_config())
    assert 81e6 < sum(p.numel() for p in full.parameters()) < 83e6


def test_frame_groups_bound_padding() -> None:
    frames = [10, 100, 12, 95, 50, 11]
    groups = km.frame_groups(frames, max_pad=0.25)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        longest = max(frames[i] for i in g)
        assert len(g) * longest <= 1.25 * sum(frames[i] for i in g)
    assert groups[0] == [0, 5, 2]  # shortest first
    assert all(len(g) == 1 for g in km.frame_groups(frames, max_pad=0.25, max_frames=60)[3:])


def test_batched_forward_matches_batch_one(model: Any, no_noise: None) -> None:
    ids = [[50, 83, 54, 156, 57, 16, 65, 85, 54, 46], [44, 102, 56], [61, 62, 69, 158, 123, 62, 16, 86, 56, 46, 4]]
    durations = [[3, 2, 4, 3, 3, 2, 4, 3, 2, 3], [2, 3, 4], [3] * 11]
    styles = torch.randn(3, 256) * 0.15
    batch = km.encode(model, ids, styles, [1.0] * 3, durations)
    assert [e.frames for e in batch] == [sum(d) + 2 for d in durations]
    audio = km.decode(model, batch)
    for i in range(3):
        one = km.encode(model, [ids[i]], styles[i : i + 1], [1.0], [durations[i]])[0]
        assert torch.allclose(one.en, batch[i].en, atol=1e-5) and torch.allclose(one.asr, batch[i].asr, atol=1e-5)
        ref = km.decode(model, [one])[0].numpy()
        got = audio[i].numpy()
        assert got.shape == ref.shape == (one.frames * km.SAMPLES_PER_FRAME,)
        # Equal but for the edges: the first and last frames' receptive fields reach into
        # the padding (the source's interpolation, the STFT): there up to 6% of the peak
        # on these random weights (the last 25 ms, the first 0.3%).
        peak = np.abs(ref).max() + 1e-9
        body = slice(km.SAMPLES_PER_FRAME, len(ref) - 2 * km.SAMPLES_PER_FRAME)
        assert np.abs(got[body] - ref[body]).max() / peak < 1e-4, i
        assert np.abs(got - ref).max() / peak < 0.1, i


def test_predicted_durations_follow_speed(model: Any) -> None:
    ids = [[50, 83, 54, 156, 57], [44, 102, 56, 61, 62, 69]]
    styles = torch.randn(2, 256) * 0.15
    slow = km.encode(model, ids, styles, [1.0, 1.0])
    fast = km.encode(model, ids, styles, [2.0, 2.0])
    for s, f in zip(slow, fast, strict=True):
        assert f.frames < s.frames


def test_batch_one_matches_the_package_forward(model: Any, no_noise: None) -> None:
    """encode/decode (their own text and duration encoders, LSTMs without packing, the
    fast paths) against the ``kokoro`` package's ``KModel.forward_with_tokens``."""
    ids = [50, 83, 54, 156, 57, 16, 65]
    style = torch.randn(1, 256) * 0.15
    ref, dur = model.forward_with_tokens(torch.tensor([[0, *ids, 0]]), style, 1.0)
    enc = km.encode(model, [ids], style, [1.0])
    assert enc[0].frames == int(dur.sum())
    got = km.decode(model, enc)[0]
    assert got.shape == ref.shape
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4


def _counted_forward(model: Any, n: int) -> Any:
    """What one forward of the engine's runner dispatches for ``n`` clauses of different
    lengths in one vocoder group (forced durations, as the benchmark's)."""
    from voicebot.engines.tts.kokoro_batch import Clause, torch_runner
    from voicebot.engines.tts.op_count import OpCounter

    class Done:
        def cancelled(self) -> bool:
            return False

    # Lengths out of order (the vocoder group takes its rows by index) and all different.
    batch = [Clause(ids=[50 + i, 83, 54, 57][: 4 - i % 3], style=torch.randn(256) * 0.15, speed=1.0, deadline=0.0,
                    future=Done(), durations=[3 - i % 2] * (4 - i % 3))  # type: ignore[arg-type]
             for i in range(n)]
    got: list[Any] = []
    with OpCounter(model) as oc:
        torch_runner(model, max_pad=100.0)(batch, lambda clauses, audio: got.extend(audio))
    assert len(got) == n
    return oc.counts


def test_forward_dispatch_does_not_grow_with_batch_size(model: Any) -> None:
    """On a GPU each device op is a kernel launch and each sync stalls the host: a forward
    must launch the same kernels for 2 clauses as for 8 (no per-clause pads, no packing per
    distinct length) and sync once per vocoder group (its audio to the host), not on
    every LSTM, STFT window or frame count."""
    two, eight = _counted_forward(model, 2), _counted_forward(model, 8)
    assert eight.kernels == two.kernels, (two.summary(), eight.summary())
    assert eight.host_ops == two.host_ops, (two.summary(), eight.summary())
    assert [s.split()[0] for s in eight.syncs] == ["d2h"], eight.syncs
    assert [s.split()[0] for s in two.syncs] == ["d2h"], two.syncs


def test_the_runner_times_its_forwards_phases(model: Any) -> None:
    from voicebot.engines.tts.kokoro_batch import Clause, torch_runner

    class Done:
        def cancelled(self) -> bool:
            return False

    batch = [Clause(ids=[50, 83, 54], style=torch.randn(256) * 0.15, speed=1.0, deadline=0.0, future=Done(),  # type: ignore[arg-type]
                    durations=[3, 2, 3])]
    waits = iter([0.5, 0.25])  # the left-over wait it clears first, then this forward's
    phases = torch_runner(model, lock_wait=lambda: next(waits))(batch, lambda clauses, audio: None)
    assert set(phases) == {"encode", "sync", "lock"} and phases["lock"] == 0.25
    assert phases["encode"] > 0.0 and phases["sync"] >= 0.0
    assert set(torch_runner(model)(batch, lambda clauses, audio: None)) == {"encode", "sync"}  # no lock to wait for


@pytest.mark.parametrize("frames", [2, 3, 7, 240])
def test_istft_matches_torch(frames: int) -> None:
    """The vocoder's inverse STFT without torch's host-side check (what a CUDA graph
    captures) gives torch.istft's samples, at Kokoro's n_fft 20 and hop 5."""
    gen = torch.Generator().manual_seed(frames)
    spec = torch.polar(torch.rand(3, 11, frames, generator=gen) * 2,
                       (torch.rand(3, 11, frames, generator=gen) - 0.5) * 6.3)
    window = torch.hann_window(20, periodic=True)
    want = torch.istft(spec, 20, 5, 20, window=window)
    got = km.istft(spec, window, 5)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_vocoder_inverse_is_the_plain_istft(model: Any) -> None:
    """fast_paths routes the generator's TorchSTFT.inverse through km.istft (no host sync)."""
    stft = model.decoder.generator.stft
    mag, phase = torch.rand(2, 11, 9) + 0.1, torch.rand(2, 11, 9)
    got = stft.inverse(mag, phase)
    want = torch.istft(mag * torch.exp(phase * 1j), 20, 5, 20, window=stft.window).unsqueeze(-2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert stft.inverse.__func__ is km._stft_inverse
