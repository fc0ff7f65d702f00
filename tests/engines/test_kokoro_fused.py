"""The fused decoder/vocoder forwards (voicebot/engines/tts/kokoro_fused.py) against the
package's forwards with kokoro_model's masks (``build_model(fused=False)``, the reference),
on the same weights and the same encoded batch: batch 1, a ragged batch, equal rows;
eager and ``torch.compile``-d; random weights of a small shape and the real weights
(int8 dequantised, tests/kokoro_weights.py).

Tolerances are those of the reference against itself run with another thread count (other
summation orders): on the small random model (noise source zeroed; its exp() output layer
turns rounding into peaks of 10^4) up to ~7e-4 of the peak; on the real weights (the noise
source seeded alike: a zeroed one makes the source's STFT phase a sign of rounding noise)
up to ~1e-2 of the peak, ~3e-3 in energy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kokoro_small import SMALL, zero_noise
from kokoro_weights import VOICE, kokoro_int8_dir

from voicebot.engines.tts import kokoro_model as km

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast

IDS = [[50, 83, 54, 156, 57, 16, 65, 85, 54, 46], [44, 102, 56], [61, 62, 69, 158, 123, 62, 16, 86, 56, 46, 4]]
DURATIONS = [[3, 2, 4, 3, 3, 2, 4, 3, 2, 3], [2, 3, 4], [3] * 11]
BATCHES = [[0, 1, 2], [1], [2, 2]]  # ragged (masked), batch 1, equal rows (unmasked)


@pytest.fixture
def no_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    zero_noise(monkeypatch)


def _small(**kw: Any) -> Any:
    torch.manual_seed(0)
    return km.build_model(SMALL, **kw)


@pytest.fixture(scope="module")
def small_ref() -> Any:
    return _small(fused=False)


def _compare(ref: Any, got: Any, ids: list[list[int]], styles: torch.Tensor,
             durations: list[list[int]] | None, tol: float, energy_tol: float = 1.0) -> None:
    with torch.inference_mode():
        batch = km.encode(ref, ids, styles, [1.0] * len(ids), durations)
        torch.manual_seed(5)
        want = km.decode(ref, batch)
        torch.manual_seed(5)  # the same noise source, drawn in the same order
        have = km.decode(got, batch)
    for a, b in zip(want, have, strict=True):
        assert a.shape == b.shape
        err = float((a - b).abs().max() / a.abs().max())
        assert err < tol, (len(ids), err)
        assert float((a - b).norm() / a.norm()) < energy_tol, len(ids)


def real_weights() -> tuple[str, torch.Tensor]:
    """The real Kokoro weights (int8 dequantised) and af_heart's style table; a test without
    them fails, it never skips."""
    try:
        model_dir = Path(kokoro_int8_dir())
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"Kokoro weights unavailable ({type(exc).__name__}: {exc})")
    pack = np.fromfile(model_dir / "voices" / f"{VOICE[0]}.bin", dtype=np.float32)
    return str(next(model_dir.glob("*.pth"))), torch.from_numpy(pack).reshape(-1, 256)


def test_fused_forwards_replace_the_package_ones(small_ref: Any) -> None:
    fused = _small()
    gen = fused.decoder.generator
    assert gen.forward.__func__.__module__ == "voicebot.engines.tts.kokoro_fused"
    assert small_ref.decoder.generator.forward.__func__.__module__ != "voicebot.engines.tts.kokoro_fused"
    for p, q in zip(small_ref.parameters(), fused.parameters(), strict=True):
        assert torch.equal(p, q)  # the same weights: the comparisons below test the forwards


@pytest.mark.parametrize("rows", BATCHES)
def test_fused_eager_matches_reference(small_ref: Any, rows: list[int], no_noise: None) -> None:
    styles = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * 0.15
    _compare(small_ref, _small(), [IDS[i] for i in rows], styles[rows], [DURATIONS[i] for i in rows], 3e-3)


def test_fused_compiled_matches_reference(small_ref: Any, no_noise: None) -> None:
    """Inductor's CPU backend (a C++ compiler): the same chains as one generated kernel each."""
    compiled = _small(compile=True)
    styles = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * 0.15
    for rows in ([0, 1, 2], [0, 2]):  # two ragged batches of other lengths: no recompile per length
        _compare(small_ref, compiled, [IDS[i] for i in rows], styles[rows], [DURATIONS[i] for i in rows], 3e-3)


def test_fused_matches_reference_on_real_weights() -> None:
    weights, pack = real_weights()
    config = km.random_config()
    ref = km.build_model(config, weights, fused=False)
    fused = km.build_model(config, weights)
    for rows in BATCHES[:2]:
        ids = [IDS[i] for i in rows]
        styles = torch.stack([pack[len(i) - 1] for i in ids])
        _compare(ref, fused, ids, styles, None, 3e-2, 1e-2)  # predicted (real) durations


@pytest.mark.parametrize(("dtype", "energy_tol"), [("float16", 0.03), ("bfloat16", 0.1)])
def test_half_precision_decode_stays_near_float32_on_real_weights(dtype: str, energy_tol: float) -> None:
    """tts.kokoro_dtype: the decoder and vocoder under autocast give the float32 model's
    audio, every sample finite and the same length, within the precision's rounding (each
    precision is heard back by Whisper in test_tts_kokoro_real). The norms, the F0 source's
    phase and the inverse STFT stay float32. Short clauses (forced durations, 6-9 frames): on
    a CPU without kernels for the precision torch's fallback convolutions take seconds a
    frame, and the numerics are the same on any device."""
    weights, pack = real_weights()
    config = km.random_config()
    ref = km.build_model(config, weights)
    half = km.build_model(config, weights, dtype=dtype)
    assert half.decode_dtype == getattr(torch, dtype)
    for ids, durations in (([IDS[1], IDS[1][:2]], [[2, 3, 2], [2, 2]]), ([IDS[1]], [[2, 3, 2]])):  # ragged, one row
        styles = torch.stack([pack[len(i) - 1] for i in ids])
        with torch.inference_mode():
            batch = km.encode(ref, ids, styles, [1.0] * len(ids), durations)
            torch.manual_seed(5)
            want = km.decode(ref, batch)
            torch.manual_seed(5)
            have = km.decode(half, batch)
        for a, b in zip(want, have, strict=True):
            assert b.dtype == torch.float32 and a.shape == b.shape and bool(torch.isfinite(b).all())
            assert float((a - b).norm() / a.norm()) < energy_tol, (dtype, len(ids))


def test_an_unknown_decode_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="float16"):
        km.build_model(SMALL, dtype="int8")
