"""Kokoro-82M (StyleTTS2 + iSTFTNet) in torch, batched across sessions.

The ``kokoro`` package's ``KModel.forward_with_tokens`` synthesises one utterance at a
time (its duration-to-alignment step assumes batch 1). This module runs several
utterances of different lengths in one forward, on the package's own modules and weights:

1. :func:`encode`: PL-BERT, the duration predictor and the text encoder over the
   utterances' phoneme ids, padded to the longest (attention mask, packed LSTMs, the
   masks the modules already take): exact per utterance. It yields each utterance's
   frame count and its frame-rate features.
2. :func:`decode`: the prosody (F0, energy) predictor, the decoder and the iSTFTNet
   vocoder over a group of utterances padded to the longest frame count. Their layers would
   see the padding: each ``InstanceNorm1d`` is switched to statistics over each utterance's
   own frames and each conv to zeros after an utterance's end, as in batch 1
   (:func:`mask_padding`). What still differs from batch 1 is the very end of an utterance
   (the source's interpolation and STFT reach into the padding): 0.06% of the peak before
   the iSTFT in tests/test_kokoro_model.py. The vocoder's noise source is random in both.

Callers group utterances of similar frame counts (:func:`frame_groups`) so that padding
costs little. Importing this module needs torch; loading the ``kokoro`` package's
modules needs ``kokoro``, ``transformers``, ``loguru`` and ``huggingface_hub`` but not
``misaki`` (its G2P, which the package's ``__init__`` imports): see :func:`kokoro_modules`.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import sys
import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 600  # one duration unit: decoder x2, generator x10 x6, iSTFT hop 5

# hexgrad/Kokoro-82M config.json without its vocab (the real model's shape).
KOKORO_82M_SHAPE: dict[str, Any] = {
    "istftnet": {
        "upsample_kernel_sizes": [20, 12],
        "upsample_rates": [10, 6],
        "gen_istft_hop_size": 5,
        "gen_istft_n_fft": 20,
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "resblock_kernel_sizes": [3, 7, 11],
        "upsample_initial_channel": 512,
    },
    "dim_in": 64,
    "dropout": 0.2,
    "hidden_dim": 512,
    "max_conv_dim": 512,
    "max_dur": 50,
    "multispeaker": True,
    "n_layer": 3,
    "n_mels": 80,
    "n_token": 178,
    "style_dim": 128,
    "text_encoder_kernel_size": 5,
    "plbert": {
        "hidden_size": 768,
        "num_attention_heads": 12,
        "intermediate_size": 2048,
        "max_position_embeddings": 512,
        "num_hidden_layers": 12,
        "dropout": 0.1,
    },
}

# Its vocab: the phoneme symbols (misaki / espeak-ng IPA) the model was trained on.
KOKORO_VOCAB: dict[str, int] = {
    ";": 1, ":": 2, ",": 3, ".": 4, "!": 5, "?": 6, "—": 9, "…": 10, "\"": 11, "(": 12, ")": 13, "“": 14,
    "”": 15, " ": 16, "̃": 17, "ʣ": 18, "ʥ": 19, "ʦ": 20, "ʨ": 21, "ᵝ": 22, "ꭧ": 23, "A": 24, "I": 25,
    "O": 31, "Q": 33, "S": 35, "T": 36, "W": 39, "Y": 41, "ᵊ": 42, "a": 43, "b": 44, "c": 45, "d": 46,
    "e": 47, "f": 48, "h": 50, "i": 51, "j": 52, "k": 53, "l": 54, "m": 55, "n": 56, "o": 57, "p": 58,
    "q": 59, "r": 60, "s": 61, "t": 62, "u": 63, "v": 64, "w": 65, "x": 66, "y": 67, "z": 68, "ɑ": 69,
    "ɐ": 70, "ɒ": 71, "æ": 72, "β": 75, "ɔ": 76, "ɕ": 77, "ç": 78, "ɖ": 80, "ð": 81, "ʤ": 82, "ə": 83,
    "ɚ": 85, "ɛ": 86, "ɜ": 87, "ɟ": 90, "ɡ": 92, "ɥ": 99, "ɨ": 101, "ɪ": 102, "ʝ": 103, "ɯ": 110, "ɰ": 111,
    "ŋ": 112, "ɳ": 113, "ɲ": 114, "ɴ": 115, "ø": 116, "ɸ": 118, "θ": 119, "œ": 120, "ɹ": 123, "ɾ": 125,
    "ɻ": 126, "ʁ": 128, "ɽ": 129, "ʂ": 130, "ʃ": 131, "ʈ": 132, "ʧ": 133, "ʊ": 135, "ʋ": 136, "ʌ": 138,
    "ɣ": 139, "ɤ": 140, "χ": 142, "ʎ": 143, "ʒ": 147, "ʔ": 148, "ˈ": 156, "ˌ": 157, "ː": 158, "ʰ": 162,
    "ʲ": 164, "↓": 169, "→": 171, "↗": 172, "↘": 173, "ᵻ": 177,
}


def kokoro_modules() -> types.ModuleType:
    """``kokoro.model`` without running ``kokoro/__init__.py`` (which imports misaki's G2P)."""
    if "kokoro.model" in sys.modules:
        return sys.modules["kokoro.model"]
    spec = importlib.util.find_spec("kokoro")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the kokoro package is not installed (pip install --no-deps kokoro)")
    if "kokoro" not in sys.modules:
        pkg = types.ModuleType("kokoro")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["kokoro"] = pkg
    if importlib.util.find_spec("attr") is None:  # custom_stft.py's unused `from attr import attr`
        stub = types.ModuleType("attr")
        stub.attr = None  # type: ignore[attr-defined]
        sys.modules["attr"] = stub
    return importlib.import_module("kokoro.model")


def build_model(config: dict[str, Any], weights: str | None = None, device: str = "cpu") -> Any:
    """A ``KModel`` of ``config``'s shape, weight norms folded; ``weights``: a ``.pth`` file
    (hexgrad's, with weight norms, or one already folded), None for random weights."""
    kmodel = kokoro_modules().KModel
    empty = io.BytesIO()
    torch.save({}, empty)
    empty.seek(0)
    model = kmodel(repo_id="hexgrad/Kokoro-82M", config=config, model=empty)  # random weights
    if weights is None:
        fold_weight_norms(model)
    else:
        groups = torch.load(weights, map_location="cpu", weights_only=True)
        folded = not any(k.endswith("weight_g") for sd in groups.values() for k in sd)
        if folded:
            fold_weight_norms(model)
        for name, sd in groups.items():
            sd = {k.removeprefix("module."): v for k, v in sd.items()}
            missing, unexpected = getattr(model, name).load_state_dict(sd, strict=False)
            # Released checkpoints lack the InstanceNorm affine parameters (kokoro added
            # affine=True for ONNX export; they stay 1 and 0) and ALBERT's unused pooler.
            missing = [k for k in missing if not k.endswith((".norm.weight", ".norm.bias")) and "pooler" not in k]
            if missing or unexpected:
                raise ValueError(f"{weights}: {name}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if not folded:
            fold_weight_norms(model)
    model = model.to(device).eval()
    mask_padding(model)
    return model


def fold_weight_norms(model: nn.Module) -> int:
    """Bake each ``weight_norm`` (g, v) into a plain weight, as an inference export does: else
    every conv recomputes its weight on every forward (hundreds of small kernels), and
    concurrent forwards on several threads would swap each other's ``module.weight``."""
    folded = 0
    for mod in model.modules():
        if hasattr(mod, "weight_g") and hasattr(mod, "weight_v"):
            nn.utils.remove_weight_norm(mod)
            folded += 1
    return folded


def random_config() -> dict[str, Any]:
    """hexgrad/Kokoro-82M's config.json (shape and vocab), for a model of random weights."""
    return {**KOKORO_82M_SHAPE, "vocab": dict(KOKORO_VOCAB)}


# --- masked instance norm ------------------------------------------------------------

# Per thread (one per forward slot): .frames: [B] each utterance's frame count (None: no
# padding), .fmax: the padded count, .masks: the masks made from them, by length.
_ctx = threading.local()


def _mask(x: torch.Tensor) -> torch.Tensor | None:
    """[B, 1, L] 1.0 over each utterance's own frames at ``x``'s length, or None (no padding)."""
    frames = getattr(_ctx, "frames", None)
    if frames is None:
        return None
    length = x.shape[-1]
    cache: dict[tuple[int, torch.dtype], torch.Tensor] = _ctx.masks
    m = cache.get((length, x.dtype))
    if m is None:
        # Every layer's length is a * frames + c (c: 0, or the generator's +1 sample of
        # reflection padding): an utterance of f frames has a * f + c of them.
        scale = length // _ctx.fmax
        valid = frames * scale + (length - scale * _ctx.fmax)  # [B]
        m = (torch.arange(length, device=x.device)[None, :] < valid[:, None]).to(x.dtype)[:, None, :]
        cache[(length, x.dtype)] = m
    return m


def _masked_instance_norm(self: nn.InstanceNorm1d, x: torch.Tensor) -> torch.Tensor:
    m = _mask(x)
    if m is None:
        return F.instance_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
    n = m.sum(-1, keepdim=True)
    mean = (x * m).sum(-1, keepdim=True) / n
    xc = (x - mean) * m
    var = (xc * xc).sum(-1, keepdim=True) / n
    y = xc * torch.rsqrt(var + self.eps)
    if self.weight is not None:
        y = y * self.weight[None, :, None] + self.bias[None, :, None]
    return y * m


def _masked_conv(self: nn.Conv1d | nn.ConvTranspose1d, x: torch.Tensor) -> torch.Tensor:
    m = _mask(x)
    return type(self).forward(self, x if m is None else x * m)  # zeros past the end, as in batch 1


def mask_padding(model: nn.Module) -> None:
    """Make ``model``'s frame-rate layers blind to padding (see ``_ctx``): each InstanceNorm1d
    takes statistics over each utterance's own frames, and each conv sees zeros after an
    utterance's end (as batch 1 does) instead of what the layers before made of the padding."""
    for mod in model.modules():
        if isinstance(mod, nn.InstanceNorm1d):
            mod.forward = types.MethodType(_masked_instance_norm, mod)  # type: ignore[method-assign]
        elif isinstance(mod, (nn.Conv1d, nn.ConvTranspose1d)):
            mod.forward = types.MethodType(_masked_conv, mod)  # type: ignore[method-assign]


# --- the two stages ------------------------------------------------------------------


@dataclass
class Encoded:
    """One utterance after :func:`encode`: frame-rate features, on the model's device."""

    en: torch.Tensor  # [hidden + style, frames]: prosody predictor input
    asr: torch.Tensor  # [hidden, frames]: aligned text encoding
    style: torch.Tensor  # [256]: the voice's reference style vector
    frames: int


def _lstm(lstm: nn.LSTM, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``lstm`` over batch-first ``x`` whose rows are ``lengths`` long (CPU tensor); padded out."""
    lstm.flatten_parameters()
    if bool((lengths == x.shape[1]).all()):
        return lstm(x)[0]
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    out, _ = lstm(packed)
    return nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


@torch.no_grad()
def encode(
    model: Any,
    ids: Sequence[Sequence[int]],
    styles: torch.Tensor,
    speeds: Sequence[float],
    durations: Sequence[Sequence[int]] | None = None,
) -> list[Encoded]:
    """Stage 1 for a batch: ``ids`` phoneme ids per utterance (without the boundary 0s),
    ``styles`` [B, 256] on the model's device. ``durations``: frames per phoneme forced
    instead of predicted (random weights predict nonsense lengths); same lengths as ``ids``."""
    dev = model.device
    b = len(ids)
    lengths = torch.tensor([len(i) + 2 for i in ids], dtype=torch.long)
    t = int(lengths.max())
    input_ids = torch.zeros((b, t), dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, 1 : 1 + len(seq)] = torch.tensor(list(seq), dtype=torch.long)
    input_ids = input_ids.to(dev)
    text_mask = (torch.arange(t)[None, :] + 1 > lengths[:, None]).to(dev)  # True: padding
    bert = model.bert(input_ids, attention_mask=(~text_mask).int())
    d_en = model.bert_encoder(bert).transpose(-1, -2)
    s = styles[:, 128:]
    d = model.predictor.text_encoder(d_en, s, lengths, text_mask)  # [B, T, hidden + style]
    if durations is None:
        x = _lstm(model.predictor.lstm, d, lengths)
        dur = torch.sigmoid(model.predictor.duration_proj(x)).sum(dim=-1)
        dur = dur / torch.tensor(list(speeds), device=dev)[:, None]
        pred = torch.round(dur).clamp(min=1).long().masked_fill(text_mask, 0)
    else:
        pred = torch.zeros((b, t), dtype=torch.long)
        for row, seq in enumerate(durations):
            pred[row, 1 : 1 + len(seq)] = torch.tensor(list(seq), dtype=torch.long)
            pred[row, 0] = pred[row, len(seq) + 1] = 1
        pred = pred.to(dev)
    cum = pred.cumsum(dim=1)
    frames = cum[:, -1].cpu()
    fmax = int(frames.max())
    f = torch.arange(fmax, device=dev)
    tok = torch.searchsorted(cum, f.expand(b, fmax).contiguous(), right=True).clamp(max=t - 1)
    valid = (f[None, :] < frames.to(dev)[:, None]).to(d.dtype)
    aln = torch.zeros((b, t, fmax), device=dev, dtype=d.dtype)
    aln.scatter_(1, tok[:, None, :], valid[:, None, :])
    en = d.transpose(-1, -2) @ aln
    t_en = model.text_encoder(input_ids, lengths, text_mask)
    asr = t_en @ aln
    return [
        Encoded(en=en[i, :, : int(frames[i])], asr=asr[i, :, : int(frames[i])], style=styles[i], frames=int(frames[i]))
        for i in range(b)
    ]


def _pad(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    return torch.stack([F.pad(r, (0, length - r.shape[-1])) for r in rows])


@torch.no_grad()
def decode(model: Any, items: Sequence[Encoded]) -> list[torch.Tensor]:
    """Stage 2 for a group: each utterance's audio (float32, on the model's device)."""
    frames = torch.tensor([it.frames for it in items], dtype=torch.long)
    fmax = int(frames.max())
    en = _pad([it.en for it in items], fmax)
    asr = _pad([it.asr for it in items], fmax)
    styles = torch.stack([it.style for it in items])
    s = styles[:, 128:]
    ragged = bool((frames != fmax).any())
    _ctx.frames = frames.to(model.device) if ragged else None
    _ctx.fmax = fmax
    _ctx.masks = {}
    try:
        pred = model.predictor
        x = _lstm(pred.shared, en.transpose(-1, -2), frames).transpose(-1, -2)
        f0 = x
        for block in pred.F0:
            f0 = block(f0, s)
        f0 = pred.F0_proj(f0).squeeze(1)
        n = x
        for block in pred.N:
            n = block(n, s)
        n = pred.N_proj(n).squeeze(1)
        audio = model.decoder(asr, f0, n, styles[:, :128])  # [B, 1, samples]
    finally:
        _ctx.frames = None
        _ctx.masks = {}
    audio = audio.reshape(len(items), -1)
    return [audio[i, : it.frames * SAMPLES_PER_FRAME] for i, it in enumerate(items)]


def frame_groups(frames: Sequence[int], max_pad: float = 0.25, max_frames: int = 1 << 30) -> list[list[int]]:
    """Indices of ``frames`` in groups of similar length, shortest first: within a group the
    padded size (members x longest) stays within ``1 + max_pad`` of the real frames and
    within ``max_frames``. A plain function of its arguments (tested directly)."""
    order = sorted(range(len(frames)), key=lambda i: frames[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i in order:
        longest = frames[i]  # sorted: the newcomer is the longest so far
        padded = (len(cur) + 1) * longest
        if cur and (padded > (1 + max_pad) * (total + frames[i]) or padded > max_frames):
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += frames[i]
    if cur:
        groups.append(cur)
    return groups
