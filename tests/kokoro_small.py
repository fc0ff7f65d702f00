"""Kokoro-82M's modules at a small shape, for the engine tests of its batched forward.

The real shape is 82 M parameters; this one keeps every code path (the decoder and the
vocoder at their real widths, a small PL-BERT and one LSTM layer) at a fraction of the
CPU time. The vocoder's noise source can be zeroed so that two runs compare sample by sample.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from voicebot.engines.tts import kokoro_model as km

SMALL: dict[str, Any] = {
    **km.KOKORO_82M_SHAPE,
    "hidden_dim": 512,  # the decoder hard-codes 512 (asr_res)
    "n_layer": 1,
    "plbert": {"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
               "max_position_embeddings": 512, "num_hidden_layers": 2, "dropout": 0.1},
    "vocab": km.KOKORO_VOCAB,
}


def zero_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vocoder's random source silenced, for sample-by-sample comparisons."""
    monkeypatch.setattr(torch, "randn_like", lambda x, **kw: torch.zeros_like(x))
    monkeypatch.setattr(torch, "rand", lambda *size, **kw: torch.zeros(*size, **kw))


def small_model() -> Any:
    """A model of :data:`SMALL`'s shape with seeded random weights."""
    torch.manual_seed(0)
    return km.build_model(SMALL)
