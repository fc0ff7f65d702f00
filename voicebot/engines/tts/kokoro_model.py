"""Kokoro-82M (StyleTTS2 + iSTFTNet) in torch, batched across sessions.

The ``kokoro`` package's ``KModel.forward_with_tokens`` synthesises one utterance at a
time (its duration-to-alignment step assumes batch 1). This module runs several
utterances of different lengths in one forward, on the package's own modules and weights:

1. :func:`encode`: PL-BERT, the duration predictor and the text encoder over the
   utterances' phoneme ids, padded to the longest (attention mask, LSTMs that stop at
   each utterance's end, the masks the modules already take): exact per utterance. It yields each utterance's
   frame count and its frame-rate features.
2. :func:`decode`: the prosody (F0, energy) predictor, the decoder and the iSTFTNet
   vocoder over a group of utterances padded to the longest frame count. Their layers would
   see the padding: each ``InstanceNorm1d`` is switched to statistics over each utterance's
   own frames and each conv to zeros after an utterance's end, as in batch 1
   (:func:`mask_padding`). What still differs from batch 1 is the very end of an utterance
   (the source's interpolation and STFT reach into the padding): 0.06% of the peak before
   the iSTFT in tests/engines/test_kokoro_model.py. The vocoder's noise source is random in both.

Callers group utterances of similar frame counts (:func:`frame_groups`) so that padding
costs little. Importing this module needs torch; loading the ``kokoro`` package's
modules needs ``kokoro``, ``transformers``, ``loguru`` and ``huggingface_hub`` but not
``misaki`` (its G2P, which the package's ``__init__`` imports): see :func:`kokoro_modules`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from voicebot.engines.tts import kokoro_fused
from voicebot.engines.tts.kokoro_fused import RSQRT2
from voicebot.engines.tts.kokoro_padding import padded, padding_masks

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


# tts.kokoro_dtype: the decoder's and vocoder's precision (decode_rows)
DECODE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_precision(device: str, dtype: str) -> bool:
    """Whether ``device`` has kernels for ``dtype``'s convolutions: float32 and CUDA always;
    a CPU only where oneDNN has them (AVX-512 BF16 or FP16, AMX). Elsewhere torch falls back
    to its reference convolutions, and a half-precision decode is far slower than float32's."""
    if dtype == "float32" or not device.startswith("cpu"):
        return True
    check = {"bfloat16": torch.ops.mkldnn._is_mkldnn_bf16_supported, "float16": torch.ops.mkldnn._is_mkldnn_fp16_supported}
    return bool(check[dtype]())


def build_model(config: dict[str, Any], weights: str | None = None, device: str = "cpu", *,
                fused: bool = True, compile: bool = False, dtype: str = "float32") -> Any:
    """A ``KModel`` of ``config``'s shape, weight norms folded; ``weights``: a ``.pth`` file
    (hexgrad's, with weight norms, or one already folded), None for random weights.
    ``fused``: the decoder's and vocoder's chains in fewer passes (``kokoro_fused``), each
    one ``torch.compile``-d function with ``compile``; not ``fused``: the package's forwards
    with only this module's masks and fast paths (the reference the fused ones are tested
    and measured against). ``dtype``: the decoder's and vocoder's precision under autocast
    (:func:`decode_rows`); the weights stay float32."""
    if dtype not in DECODE_DTYPES:
        raise ValueError(f"dtype: one of {', '.join(DECODE_DTYPES)}, not {dtype!r}")
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
    model.decode_dtype = DECODE_DTYPES[dtype]
    mask_padding(model)
    fast_paths(model)
    if fused:
        kokoro_fused.install(model, compile=compile)
    elif compile:
        raise ValueError("compile applies to the fused forwards (fused=True)")
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


def _masked_instance_norm(self: nn.InstanceNorm1d, x: torch.Tensor) -> torch.Tensor:
    mw = padding_masks(x)
    if mw is None:
        # One group per channel is an instance norm, in one kernel (instance_norm runs a
        # batch norm over a reshaped input, repeating the affine parameters per call).
        return F.group_norm(x, x.shape[1], self.weight, self.bias, self.eps)
    _, w = mw
    # Statistics over each utterance's own frames (means as one batched matmul each), taken
    # about the first frame: a near-constant channel (an unvoiced source) then centres to
    # ~0 exactly instead of to the rounding of a 4,000-term sum, which the 1 / sqrt(eps)
    # of a zero variance would blow up. The padding is left as it comes (not zeroed): every
    # conv masks its input, so it reaches no utterance's frames.
    d = x - x[:, :, :1]
    xc = d - torch.bmm(d, w)
    y = xc * torch.rsqrt(torch.bmm(xc * xc, w) + self.eps)
    if self.weight is not None:
        y = torch.addcmul(self.bias[:, None], y, self.weight[:, None])
    return y


def _masked_conv(self: nn.Conv1d | nn.ConvTranspose1d, x: torch.Tensor) -> torch.Tensor:
    mw = padding_masks(x)
    return type(self).forward(self, x if mw is None else x * mw[0])  # zeros past the end, as in batch 1


def mask_padding(model: nn.Module) -> None:
    """Make ``model``'s frame-rate layers blind to padding (``kokoro_padding``): each InstanceNorm1d
    takes statistics over each utterance's own frames, and each conv sees zeros after an
    utterance's end (as batch 1 does) instead of what the layers before made of the padding."""
    for mod in model.modules():
        if isinstance(mod, nn.InstanceNorm1d):
            mod.forward = types.MethodType(_masked_instance_norm, mod)  # type: ignore[method-assign]
        elif isinstance(mod, (nn.Conv1d, nn.ConvTranspose1d)):
            mod.forward = types.MethodType(_masked_conv, mod)  # type: ignore[method-assign]


def _adain_resblk_forward(self: Any, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (self._residual(x, s) + self._shortcut(x)) * RSQRT2


def _snake_resblock_forward(self: Any, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """AdaINResBlock1.forward with each Snake's 1 / alpha made once (``_inv``): 4 kernels, not 6."""
    for c1, c2, n1, n2, a1, a2, i1, i2 in zip(self.convs1, self.convs2, self.adain1, self.adain2,
                                              self.alpha1, self.alpha2, *self._inv, strict=True):
        xt = n1(x, s)
        xt = torch.addcmul(xt, i1, torch.sin(a1 * xt).square())
        xt = c1(xt)
        xt = n2(xt, s)
        xt = torch.addcmul(xt, i2, torch.sin(a2 * xt).square())
        xt = c2(xt)
        x = xt + x
    return x


def _sine_gen_forward(self: Any, f0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SineGen.forward with its harmonic numbers made once on the device (``_harmonics``):
    the package builds them on the CPU and copies them over on every call, a blocking copy
    that makes the host wait for the device in the middle of the vocoder."""
    sine_waves = self._f02sine(f0 * self._harmonics) * self.sine_amp
    uv = self._f02uv(f0)
    noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
    noise = noise_amp * torch.randn_like(sine_waves)
    return sine_waves * uv + noise, uv, noise


def istft(spec: torch.Tensor, window: torch.Tensor, hop: int) -> torch.Tensor:
    """``torch.istft(spec, n_fft, hop, window=window)`` (``center=True``, no ``length``) in
    plain tensor ops: [B, n_fft // 2 + 1, T] complex -> [B, samples]. torch's own checks
    the window's overlap-add envelope on the host (``.item()``), a sync that no CUDA graph
    can capture; a Hann window at Kokoro's hop never fails that check, so it is left out."""
    n_fft = window.shape[0]
    b, _, t = spec.shape
    frames = torch.fft.irfft(spec, n=n_fft, dim=1) * window[None, :, None]  # [B, n_fft, T]
    length = n_fft + hop * (t - 1)
    fold = functools.partial(F.fold, output_size=(1, length), kernel_size=(1, n_fft), stride=(1, hop))
    y = fold(frames).reshape(b, length)
    envelope = fold((window * window)[None, :, None].expand(1, n_fft, t)).reshape(length)
    half = n_fft // 2
    return y[:, half : length - half] / envelope[half : length - half]


def _stft_inverse(self: Any, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """TorchSTFT.inverse through :func:`istft`: [B, 1, samples]. In float32 whatever the
    vocoder's precision (``decode_dtype``): the FFT takes no bfloat16, and the waveform is
    the sum of overlapping frames, where half precision would add audible noise."""
    with torch.autocast(magnitude.device.type, enabled=False):
        return istft(torch.polar(magnitude.float(), phase.float()), self.window, self.hop_length).unsqueeze(-2)


def fast_paths(model: nn.Module) -> None:
    """Remove host work and host-device syncs that the package's modules do on every forward
    (same outputs): the STFT window and SineGen's harmonic numbers are made once on the
    model's device, the inverse STFT skips torch's host-side window check (:func:`istft`), Snake's 1 / alpha once, AdainResBlk1d's 1 / sqrt(2) is a constant, and
    each bidirectional LSTM gets its two directions as unidirectional LSTMs (``_bilstm``:
    padded batches without packing). Call after the model is on its device."""
    dev = next(model.parameters()).device
    for mod in model.modules():
        name = type(mod).__name__
        if name == "AdainResBlk1d":
            mod.forward = types.MethodType(_adain_resblk_forward, mod)  # type: ignore[method-assign]
        elif name == "AdaINResBlock1":
            mod._inv = ([1 / a.detach() for a in mod.alpha1], [1 / a.detach() for a in mod.alpha2])
            mod.forward = types.MethodType(_snake_resblock_forward, mod)  # type: ignore[method-assign]
        elif name == "SineGen":
            harmonics = torch.arange(1, mod.dim + 1, dtype=torch.float32, device=dev)[None, None, :]
            mod.register_buffer("_harmonics", harmonics, persistent=False)
            mod.forward = types.MethodType(_sine_gen_forward, mod)  # type: ignore[method-assign]
        elif name == "TorchSTFT":
            window = mod.window  # a plain attribute: copied to the device on every call
            del mod.window
            mod.register_buffer("window", window.to(dev), persistent=False)
            mod.inverse = types.MethodType(_stft_inverse, mod)  # type: ignore[method-assign]
        elif isinstance(mod, nn.LSTM) and mod.bidirectional and mod.num_layers == 1 and mod.batch_first:
            dirs = []
            for suffix in ("", "_reverse"):
                one = nn.LSTM(mod.input_size, mod.hidden_size, 1, bias=mod.bias, batch_first=True).to(dev)
                with torch.no_grad():
                    for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                        if hasattr(one, f"{p}_l0"):
                            getattr(one, f"{p}_l0").copy_(getattr(mod, f"{p}_l0{suffix}"))
                one.flatten_parameters()
                dirs.append(one.eval())
            mod.__dict__["_directions"] = tuple(dirs)  # not a submodule: stays out of state_dict
    bert = getattr(model, "bert", None)
    if bert is not None and getattr(bert, "pooler", None) is not None:
        bert.pooler = None  # ALBERT's pooled output: unused


# --- the two stages ------------------------------------------------------------------


@dataclass(eq=False)
class EncodedBatch:
    """:func:`encode`'s output for a whole batch, on the model's device, padded to ``fmax``."""

    en: torch.Tensor  # [B, hidden + style, fmax]: prosody predictor input
    asr: torch.Tensor  # [B, hidden, fmax]: aligned text encoding
    styles: torch.Tensor  # [B, 256]
    frames_dev: torch.Tensor  # [B] frame counts (long)
    frames: list[int]  # the same on the host


@dataclass(eq=False)
class Encoded:
    """One utterance after :func:`encode`: a row of its batch (frame-rate features)."""

    batch: EncodedBatch
    row: int
    frames: int

    @property
    def en(self) -> torch.Tensor:  # [hidden + style, frames]
        return self.batch.en[self.row, :, : self.frames]

    @property
    def asr(self) -> torch.Tensor:  # [hidden, frames]
        return self.batch.asr[self.row, :, : self.frames]

    @property
    def style(self) -> torch.Tensor:  # [256]: the voice's reference style vector
        return self.batch.styles[self.row]


@dataclass
class _Padding:
    """A padded batch's rows of different lengths, on the device, for :func:`_bilstm`."""

    valid: torch.Tensor  # [B, T, 1] 1.0 over each row's own steps
    rev: torch.Tensor  # [B, T] index that reverses each row within its length (padding stays)


def _padding(lengths: torch.Tensor, t: int) -> _Padding:
    j = torch.arange(t, device=lengths.device)[None, :]
    n = lengths[:, None]
    inside = j < n
    return _Padding(valid=inside[:, :, None].float(), rev=torch.where(inside, n - 1 - j, j))


def _bilstm(lstm: nn.LSTM, x: torch.Tensor, pad: _Padding | None) -> torch.Tensor:
    """A bidirectional ``lstm`` over batch-first ``x`` whose rows have their own lengths,
    zeros past each row's end: what packing gives, without packing (which sorts, copies an
    index to the device, and copies once per distinct length). The forward direction runs
    over the padded rows (the padding comes after a row's steps); the backward one over each
    row reversed within its length, reversed back."""
    if pad is None:
        return lstm(x)[0]
    fwd, bwd = lstm.__dict__["_directions"]
    hf = fwd(x)[0]
    rx = pad.rev[:, :, None]
    hb = bwd(x.gather(1, rx.expand(-1, -1, x.shape[2])))[0]
    hb = hb.gather(1, rx.expand(-1, -1, hb.shape[2]))
    return torch.cat([hf, hb], dim=-1) * pad.valid


def _text_encoder(te: Any, ids: torch.Tensor, mask: torch.Tensor, pad: _Padding | None) -> torch.Tensor:
    """kokoro's ``TextEncoder.forward`` with the LSTM through :func:`_bilstm`: [B, hidden, T]."""
    m = mask.unsqueeze(1)
    x = te.embedding(ids).transpose(1, 2).masked_fill(m, 0.0)
    for c in te.cnn:
        x = c(x).masked_fill(m, 0.0)
    return _bilstm(te.lstm, x.transpose(1, 2), pad).transpose(-1, -2)


def _duration_encoder(de: Any, x: torch.Tensor, style: torch.Tensor, mask: torch.Tensor,
                      pad: _Padding | None) -> torch.Tensor:
    """kokoro's ``DurationEncoder.forward`` with its LSTMs through :func:`_bilstm`: [B, T, hidden + style]."""
    b, _, t = x.shape
    s = style[:, :, None].expand(b, style.shape[1], t)
    m = mask.unsqueeze(1)
    x = torch.cat([x, s], dim=1).masked_fill(m, 0.0)  # [B, C, T]
    for block in de.lstms:
        if isinstance(block, nn.LSTM):
            x = _bilstm(block, x.transpose(-1, -2), pad).transpose(-1, -2)
        else:
            x = block(x.transpose(-1, -2), style).transpose(-1, -2)
            x = torch.cat([x, s], dim=1).masked_fill(m, 0.0)
    return x.transpose(-1, -2)


@dataclass(eq=False)
class TokenBatch:
    """A batch's phonemes on the device, padded to ``rows`` x ``t`` (:func:`tokens`)."""

    ids: torch.Tensor  # [rows, t] long, boundary 0s around each row's phonemes
    lengths: torch.Tensor  # [rows] long: each row's length with its boundaries
    forced: torch.Tensor | None  # [rows, t] long: frames per phoneme, None: predicted
    frames: list[int] | None  # forced frame counts of the real rows, known on the host
    ragged: bool  # rows of different lengths: the masked path


def tokens(device: Any, ids: Sequence[Sequence[int]], durations: Sequence[Sequence[int]] | None = None, *,
           rows: int | None = None, t: int | None = None) -> TokenBatch:
    """The phoneme ids (and forced durations) of a batch on ``device`` in one non-blocking
    copy, padded to ``rows`` x ``t`` if given (a bucket: padded rows are zeros of full length
    and one frame per phoneme, rows of their own)."""
    b = len(ids)
    lens = [len(i) + 2 for i in ids]
    rows = b if rows is None else rows
    t = max(lens) if t is None else t
    if rows < b or t < max(lens):
        raise ValueError(f"{b} clauses of up to {max(lens)} tokens do not fit {rows} x {t}")
    out = np.zeros((2 * rows if durations is not None else rows, t + 1), dtype=np.int64)
    for row, seq in enumerate(ids):
        out[row, 1 : 1 + len(seq)] = seq
    out[:b, t] = lens
    out[b:rows, t] = t
    frames = None
    if durations is not None:
        for row, seq in enumerate(durations):
            out[rows + row, 1 : 1 + len(seq)] = seq
            out[rows + row, 0] = out[rows + row, len(seq) + 1] = 1
        out[rows + b :, :t] = 1
        frames = [sum(seq) + 2 for seq in durations]
    buf = torch.from_numpy(out).to(device, non_blocking=True)
    return TokenBatch(ids=buf[:rows, :t], lengths=buf[:rows, t], forced=None if durations is None else buf[rows:, :t],
                      frames=frames, ragged=rows > b or any(n != t for n in lens))


def encode_tokens(model: Any, ids: torch.Tensor, lengths: torch.Tensor, styles: torch.Tensor,
                  speeds: torch.Tensor | None, forced: torch.Tensor | None, *,
                  ragged: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1 up to the alignment, device work only (no sync, fixed shapes: what
    ``kokoro_graphs.BucketedEncoder`` captures): ``d`` [B, T, hidden + style] (the prosody
    features per phoneme), ``t_en`` [B, hidden, T] (the text encoding) and ``cum`` [B, T]
    (each phoneme's last frame + 1; its last column the frame count). ``forced``: frames per
    phoneme; None: predicted at ``speeds`` [B]. ``ragged``: rows of different lengths,
    masked; False only when every row is ``T`` long."""
    b, t = ids.shape
    dev = ids.device
    mask = torch.arange(t, device=dev)[None, :] >= lengths[:, None]  # True: padding
    pad = _padding(lengths, t) if ragged else None
    attn = None
    if ragged:  # a prepared 4D mask: transformers would check a 2D one with .all() (a sync)
        neg = torch.finfo(styles.dtype).min
        attn = torch.zeros((b, 1, 1, t), device=dev, dtype=styles.dtype).masked_fill(mask[:, None, None, :], neg)
        attn = attn.expand(b, 1, t, t)
    bert = model.bert(ids, attention_mask=attn)
    d_en = model.bert_encoder(bert).transpose(-1, -2)
    d = _duration_encoder(model.predictor.text_encoder, d_en, styles[:, 128:], mask, pad)  # [B, T, hidden + style]
    t_en = _text_encoder(model.text_encoder, ids, mask, pad)
    if forced is None:
        assert speeds is not None, "predicted durations need the speeds"
        x = _bilstm(model.predictor.lstm, d, pad)
        dur = torch.sigmoid(model.predictor.duration_proj(x)).sum(dim=-1) / speeds[:, None]
        forced = torch.round(dur).clamp(min=1).long().masked_fill(mask, 0)
    return d, t_en, forced.cumsum(dim=1)


def align(d: torch.Tensor, t_en: torch.Tensor, cum: torch.Tensor, styles: torch.Tensor,
          frames: list[int] | None = None) -> list[Encoded]:
    """Stage 1's end: :func:`encode_tokens`' rows (as many as ``styles``) at frame rate.
    ``frames``: the frame counts if the host knows them (forced); else read from ``cum``,
    the forward's one sync."""
    b = styles.shape[0]
    d, t_en, cum = d[:b], t_en[:b], cum[:b]
    t = cum.shape[1]
    frames_dev = cum[:, -1]
    if frames is None:
        frames = frames_dev.tolist()  # the frame counts set every shape after this: one sync
    fmax = max(frames)
    f = torch.arange(fmax, device=cum.device)
    tok = torch.searchsorted(cum, f.expand(b, fmax).contiguous(), right=True).clamp(max=t - 1)
    valid = (f[None, :] < frames_dev[:, None]).to(d.dtype)
    aln = torch.zeros((b, t, fmax), device=cum.device, dtype=d.dtype)
    aln.scatter_(1, tok[:, None, :], valid[:, None, :])
    batch = EncodedBatch(en=d.transpose(-1, -2) @ aln, asr=t_en @ aln, styles=styles, frames_dev=frames_dev,
                         frames=frames)
    return [Encoded(batch, i, frames[i]) for i in range(b)]


def speeds_tensor(speeds: Sequence[float], rows: int, like: torch.Tensor) -> torch.Tensor:
    """``speeds`` as a [rows] tensor on ``like``'s device (padded rows at 1.0)."""
    host = torch.ones(rows, dtype=like.dtype)
    host[: len(speeds)] = torch.tensor(list(speeds), dtype=like.dtype)
    return host.to(like.device, non_blocking=True)


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
    instead of predicted (random weights predict nonsense lengths); same lengths as ``ids``.

    Host work and syncs are kept to a constant: the ids, lengths and forced durations go to
    the device in one non-blocking copy; the only sync is reading the predicted frame counts
    (none with forced durations), after the text encoder has been launched."""
    tb = tokens(model.device, ids, durations)
    speed = None if durations is not None else speeds_tensor(speeds, len(ids), styles)
    d, t_en, cum = encode_tokens(model, tb.ids, tb.lengths, styles, speed, tb.forced, ragged=tb.ragged)
    return align(d, t_en, cum, styles, tb.frames)


def _pad(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    return torch.stack([F.pad(r, (0, length - r.shape[-1])) for r in rows])


def gather(items: Sequence[Encoded], fmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """en, asr, styles and frame counts of ``items``, padded to ``fmax``, on the device: rows
    of their batch's tensors (one index copy, not a pad per item) when they share one."""
    batch = items[0].batch
    dev = batch.en.device
    if any(it.batch is not batch for it in items):
        frames = torch.tensor([it.frames for it in items]).to(dev, non_blocking=True)
        return (_pad([it.en for it in items], fmax), _pad([it.asr for it in items], fmax),
                torch.stack([it.style for it in items]), frames)
    rows = [it.row for it in items]
    if rows == list(range(len(batch.frames))):
        return batch.en[..., :fmax], batch.asr[..., :fmax], batch.styles, batch.frames_dev
    idx = torch.tensor(rows).to(dev, non_blocking=True)
    return (batch.en.index_select(0, idx)[..., :fmax], batch.asr.index_select(0, idx)[..., :fmax],
            batch.styles.index_select(0, idx), batch.frames_dev.index_select(0, idx))


@torch.no_grad()
def decode(model: Any, items: Sequence[Encoded]) -> list[torch.Tensor]:
    """Stage 2 for a group: each utterance's audio (float32, on the model's device)."""
    frames = [it.frames for it in items]
    fmax = max(frames)
    en, asr, styles, frames_dev = gather(items, fmax)
    audio = decode_rows(model, en, asr, styles, frames_dev, masked=len(set(frames)) > 1)
    return [audio[i, : f * SAMPLES_PER_FRAME] for i, f in enumerate(frames)]


def decode_rows(model: Any, en: torch.Tensor, asr: torch.Tensor, styles: torch.Tensor, frames_dev: torch.Tensor,
                *, masked: bool) -> torch.Tensor:
    """Stage 2 on padded tensors: ``en`` [B, hidden + style, F], ``asr`` [B, hidden, F],
    ``styles`` [B, 256], ``frames_dev`` [B] each row's frame count (``masked``: some are
    below F, so every norm and conv is made blind to the padding) -> audio [B, F x 600].
    No host sync and no shape that depends on tensor values: the function a CUDA graph
    captures (``kokoro_graphs``)."""
    fmax = en.shape[-1]
    s = styles[:, 128:]
    with padded(frames_dev if masked else None, fmax):
        pred = model.predictor
        x = _bilstm(pred.shared, en.transpose(-1, -2), _padding(frames_dev, fmax) if masked else None).transpose(-1, -2)
        f0 = x
        for block in pred.F0:
            f0 = block(f0, s)
        f0 = pred.F0_proj(f0).squeeze(1)
        n = x
        for block in pred.N:
            n = block(n, s)
        n = pred.N_proj(n).squeeze(1)
        # The decoder and vocoder are most of the work: their convolutions at decode_dtype
        # (autocast keeps norms and reductions in float32). No autocast cache: a CUDA graph
        # captures this, and cached casts would be freed outside it.
        low = model.decode_dtype != torch.float32
        with torch.autocast(en.device.type, dtype=model.decode_dtype, enabled=low, cache_enabled=False):
            audio = model.decoder(asr, f0, n, styles[:, :128])  # [B, 1, samples]
        audio = audio.float()
    return audio.reshape(en.shape[0], -1)


def feature_channels(model: Any) -> tuple[int, int]:
    """The channels of :func:`encode`'s two frame-rate features (``en``, ``asr``), from one
    tiny encode rather than worked out from the config."""
    probe = encode(model, [[1, 2, 3]], torch.zeros(1, 256, device=model.device), [1.0], [[2, 2, 2]])
    return probe[0].batch.en.shape[1], probe[0].batch.asr.shape[1]


def warm_up_compiled(model: Any, frames: int = 16) -> None:
    """One decode of each kind a compiled model meets (one row; several of one length; several
    masked to their own lengths), on zeros: Dynamo compiles per kind, with symbolic sizes, so
    the first callers after a start do not wait seconds for it."""
    dev = model.device
    with torch.inference_mode():
        en_ch, asr_ch = feature_channels(model)
        for rows, masked in ((1, False), (2, False), (2, True)):
            counts = torch.tensor([frames, frames - 1][:rows] if masked else [frames] * rows, device=dev)
            decode_rows(model, torch.zeros(rows, en_ch, frames, device=dev), torch.zeros(rows, asr_ch, frames, device=dev),
                        torch.zeros(rows, 256, device=dev), counts, masked=masked)


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
