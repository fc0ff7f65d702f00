"""The windowed Whisper model for vLLM (see voicebot/engines/asr/whisper_vllm_window.py).

Imported only by vLLM, when a config names ``VoicebotWindowedWhisper`` (registered lazily
by :func:`voicebot.vllm_plugin.register`): it needs vLLM and torch.
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from vllm.model_executor.models.whisper import (
    WhisperDummyInputsBuilder,
    WhisperForConditionalGeneration,
    WhisperMultiModalProcessor,
    WhisperProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptReplacement, PromptUpdate

from voicebot.audio import ASR_RATE
from voicebot.engines.asr.whisper_vllm_window import (
    FULL_FRAMES,
    audio_lengths,
    cut_features,
    placeholder_lengths,
    window_frames_for,
    window_of,
)

__all__ = ["WindowedFeatureExtractor", "WindowedProcessor", "WindowedWhisper", "WindowedWhisperInfo"]

log = logging.getLogger(__name__)


class WindowedFeatureExtractor(WhisperFeatureExtractor):  # type: ignore[misc]
    """Whisper's feature extractor, then the features cut to the audio's window.

    Made from the checkpoint's own extractor (:meth:`of`), so the log-mel is exactly
    the stock one (padded to 30 s, normalised over the padded window, as faster-whisper
    does) before the cut."""

    window: tuple[float, float, tuple[float, ...]]

    @classmethod
    def of(cls, fe: WhisperFeatureExtractor, window: tuple[float, float, tuple[float, ...]]) -> WindowedFeatureExtractor:
        # A copy of the loaded extractor with this class: its mel filters and settings
        # as loaded, nothing recomputed.
        new = copy.copy(fe)
        new.__class__ = cls
        new.window = window
        return new

    def __call__(self, raw_speech: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(raw_speech, *args, **kwargs)
        pad_s, min_s, buckets = self.window
        # One tensor for the batch: its longest audio's window (vLLM sends one audio per call).
        frames = max(window_frames_for(n, pad_s, min_s, buckets) for n in audio_lengths(raw_speech))
        for key in ("input_features", "attention_mask"):
            if key in out:
                out[key] = cut_features(out[key], frames)
        return out


class WindowedWhisperInfo(WhisperProcessingInfo):  # type: ignore[misc]
    """Whisper's processing info with the windowed feature extractor in its HF processor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM caches HF processors (an LRU); each one it hands out is wrapped once, and
        # forgotten with it. The renderer's feature threads call this concurrently.
        self._windowed: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get_hf_processor(self, **kwargs: object) -> Any:
        proc = super().get_hf_processor(**kwargs)
        with self._lock:
            windowed = self._windowed.get(proc)
            if windowed is None:
                windowed = copy.copy(proc)
                window = window_of(self.get_hf_config())
                windowed.feature_extractor = WindowedFeatureExtractor.of(proc.feature_extractor, window)
                _check_cuts(windowed)
                log.info("Whisper encoder window: the audio + %g s, at least %g s, rounded up to %s s", *window)
                self._windowed[proc] = windowed
        return windowed


def _check_cuts(proc: Any) -> None:
    """The HF processor must call the feature extractor we put in it: a transformers
    release that routed audio elsewhere would silently encode 30 s again."""
    out = proc(audio=[np.zeros(ASR_RATE, dtype=np.float32)], sampling_rate=ASR_RATE)
    frames = np.asarray(out["input_features"][0]).shape[-1]
    if frames >= FULL_FRAMES:
        raise RuntimeError(f"the windowed Whisper processor did not cut the features ({frames} frames)")


class WindowedProcessor(WhisperMultiModalProcessor):  # type: ignore[misc]
    """Each audio's placeholder is as long as its encoder output: frames / 2 positions of
    the features the extractor produced, not always 1500."""

    def _get_prompt_updates(
        self,
        mm_items: Any,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: Any,
    ) -> Sequence[PromptUpdate]:
        lengths = placeholder_lengths(out_mm_kwargs)
        if not lengths:
            return super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)

        def replacement(item_idx: int) -> list[int]:
            return [0] * lengths[item_idx]

        return [PromptReplacement(modality="audio", target=[0], replacement=replacement)]


@MULTIMODAL_REGISTRY.register_processor(
    WindowedProcessor,
    info=WindowedWhisperInfo,
    dummy_inputs=WhisperDummyInputsBuilder,  # 30 s of dummy audio: the full window, the most positions
)
class WindowedWhisper(WhisperForConditionalGeneration):  # type: ignore[misc]
    """Whisper whose encoder takes a step's audios in groups of one window length."""

    def embed_multimodal(self, **kwargs: object) -> Any:
        feats = kwargs.get("input_features")
        if feats is None:
            return []
        if isinstance(feats, torch.Tensor) and feats.ndim == 3:  # one length: vLLM stacked them
            return self.model.get_encoder_outputs(feats.to(self.dtype)).unbind(0)
        # Of several lengths they arrive as a list of [mels, T] (or [1, mels, T]).
        items: list[torch.Tensor] = []
        stacked = feats if isinstance(feats, (list, tuple)) else cast(torch.Tensor, feats).unbind(0)
        for f in stacked:
            items.extend(f.unbind(0) if f.ndim == 3 else [f])
        groups: dict[int, list[int]] = {}
        for i, f in enumerate(items):
            groups.setdefault(int(f.shape[-1]), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(items)
        for idx in groups.values():
            batch = torch.stack([items[i].to(self.dtype) for i in idx])
            encoded = self.model.get_encoder_outputs(batch)  # [n, frames / 2, d_model]
            for j, i in enumerate(idx):
                out[i] = encoded[j]
        return tuple(out)
