"""The cache-aware streaming FastConformer + RNN-T in torch, batched over a pool of stream
slots: the synchronous half of ``asr.backend: fastconformer`` (:mod:`.fastconformer` runs it
from asyncio).

The model is transformers' ``NemotronAsrStreamingForRNNT`` (NVIDIA's Nemotron Speech
Streaming shape). Its own streaming forward keeps one ``DynamicCache`` whose length is the
same for every row, so streams that started at different times could not share a forward.
:class:`SlotPool` keeps each stream's encoder state in fixed slots instead -- the attention
keys/values of the last ``window`` frames (left-padded, with how many are real), the causal
convolution caches and the RNN-T prediction network's state -- and :meth:`SlotPool.step`
runs ONE forward of the conformer layers for every stream given, each at its own point in
its audio: the rows' left contexts are masked per row, the relative positions are the same
for all (distances from the chunk), so a stream's output is the one it would get alone. Only
the convolutional subsampling runs twice when some streams start their first chunk (that
chunk is one mel frame plus ``8 r`` long, the others ``8 (r + 1)``).

Each step encodes a chunk of ``r + 1`` encoder frames (``(r + 1) * 80`` ms) per stream, every
audio frame once, then decodes those frames greedily for all streams at once (up to
``max_symbols_per_step`` symbols a frame, as transformers' ``generate``).

Features are the model's log-mel (pre-emphasis, 25 ms Hann window in a 512-point FFT, 10 ms
hop, Slaney mel, log with a 2^-24 floor, no normalisation), computed per chunk exactly as a
``center=True`` pass over the whole utterance would (:func:`log_mel`): a stream keeps the
pre-emphasised samples it still needs, left-padded with half an FFT of zeros.

This module imports torch and transformers only (a benchmark runs it on a bare GPU machine).
CUDA graphs or ``torch.compile`` belong in :meth:`SlotPool.step`, whose shapes depend only on
how many rows it is given (pad the row count to a few sizes to capture them).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

SAMPLE_RATE = 16_000
HOP = 160
N_FFT = 512
WIN = 400
PREEMPHASIS = 0.97
LOG_GUARD = 2.0**-24
SUBSAMPLING = 8  # mel frames per encoder frame


def mel_filters(n_mels: int) -> torch.Tensor:
    """(n_mels, N_FFT // 2 + 1) Slaney-scale, Slaney-normalised filters over 0-8 kHz (librosa's)."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=SAMPLE_RATE / 2,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(np.ascontiguousarray(bank.T)).float()


def preemphasise(audio: np.ndarray, previous: float) -> np.ndarray:
    """``y[n] = x[n] - 0.97 x[n-1]``, continuing from the sample before ``audio``."""
    out = np.empty_like(audio)
    if audio.size:
        out[0] = audio[0] - PREEMPHASIS * previous
        out[1:] = audio[1:] - PREEMPHASIS * audio[:-1]
    return out


def log_mel(audio: np.ndarray, filters: torch.Tensor) -> torch.Tensor:
    """The whole utterance's features, (1, 1 + len // HOP, n_mels): the reference that chunked
    streaming reproduces frame for frame."""
    y = torch.from_numpy(preemphasise(np.asarray(audio, np.float32), 0.0))[None]
    window = torch.hann_window(WIN, periodic=False)
    spec = torch.stft(y, N_FFT, HOP, WIN, window=window, center=True, pad_mode="constant", return_complex=True)
    return torch.log(filters @ spec.abs().square() + LOG_GUARD).transpose(1, 2)


class MelFrames:
    """Log-mel frames of padded, pre-emphasised sample segments, batched (``center=False``)."""

    def __init__(self, n_mels: int, device: torch.device, dtype: torch.dtype) -> None:
        self.filters = mel_filters(n_mels).to(device)
        self.window = torch.hann_window(WIN, periodic=False, device=device)
        self.device = device
        self.dtype = dtype

    def __call__(self, segments: torch.Tensor) -> torch.Tensor:
        """(B, (T - 1) * HOP + N_FFT) samples -> (B, T, n_mels) in the model's dtype."""
        x = segments.to(self.device, non_blocking=True)
        spec = torch.stft(x, N_FFT, HOP, WIN, window=self.window, center=False, return_complex=True)
        return torch.log(self.filters @ spec.abs().square() + LOG_GUARD).transpose(1, 2).to(self.dtype)


def samples_for(frames: int) -> int:
    """Padded samples that ``frames`` consecutive mel frames span."""
    return (frames - 1) * HOP + N_FFT


@dataclass
class Row:
    """One stream's chunk in a step: its slot, its padded samples, whether it is the
    stream's first chunk (the slot's state is then fresh), and whether the slot keeps the
    state after it (not for a final's zero-padded last chunk: the caller may go on)."""

    slot: int
    samples: np.ndarray
    first: bool
    keep: bool = True


class _KvWindow:
    """The attention's ``past_key_values`` for one step: each layer's slot window is put in
    front of the chunk's keys/values, and the window's new tail is kept for the slots."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], window: int) -> None:
        self.keys, self.values, self.window = keys, values, window

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([self.keys[layer_idx], key], dim=2)
        v = torch.cat([self.values[layer_idx], value], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k[:, :, -self.window :], v[:, :, -self.window :]
        return k, v


class _ConvCache:
    """The conformer layers' causal depthwise convolution caches for one step (the
    ``padding_cache`` of their ``update`` protocol)."""

    def __init__(self, caches: dict[str, torch.Tensor]) -> None:
        self.caches = caches

    def update(self, hidden: torch.Tensor, key: str, conv: nn.Module) -> torch.Tensor:
        x = torch.cat([self.caches[key], hidden], dim=-1)
        self.caches[key] = x[..., -conv.left_pad :]
        return x


class SlotPool:
    """``slots`` streams' encoder and decoder state, and the batched step over them.

    Not thread-safe: one step at a time, from one thread. A slot is fresh again when its
    next row says ``first`` (nothing needs clearing in between).
    """

    def __init__(self, model: Any, slots: int, lookahead: int) -> None:
        from transformers.models.nemotron_asr_streaming.modeling_nemotron_asr_streaming import (
            NemotronAsrStreamingEncoderCausalConvPaddingCache,
        )

        self._padding_cache_type = NemotronAsrStreamingEncoderCausalConvPaddingCache
        self.model = model
        self.slots = slots
        self.lookahead = lookahead
        enc_cfg = model.config.encoder_config
        self.chunk_frames = lookahead + 1  # encoder frames per chunk
        self.first_mel = 1 + SUBSAMPLING * lookahead
        self.next_mel = SUBSAMPLING * self.chunk_frames
        # Frames a chunk attends to before itself: whole chunks of the model's left context.
        self.window = (enc_cfg.sliding_window - 1) // self.chunk_frames * self.chunk_frames
        self.blank = int(model.config.blank_token_id)
        self.max_symbols = int(model.config.max_symbols_per_step)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.mel = MelFrames(enc_cfg.num_mel_bins, self.device, self.dtype)
        enc = model.encoder
        heads = enc_cfg.num_attention_heads
        head_dim = enc_cfg.hidden_size // heads
        dev, dt = self.device, self.dtype
        self.keys = [torch.zeros(slots, heads, self.window, head_dim, device=dev, dtype=dt) for _ in enc.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.seen = torch.zeros(slots, dtype=torch.long, device=dev)  # real frames in the window
        self.conv = {
            f"conv.{i}": torch.zeros(slots, enc_cfg.hidden_size, layer.conv.depthwise_conv.left_pad, device=dev, dtype=dt)
            for i, layer in enumerate(enc.layers)
        }
        self.subsampling: dict[str, torch.Tensor] = {}  # shaped by the first steady step
        dec = model.decoder
        layers, hidden = model.config.num_decoder_layers, model.config.decoder_hidden_size
        with torch.inference_mode():
            blank = torch.full((1, 1), self.blank, dtype=torch.long, device=dev)
            out, (h0, c0) = dec.lstm(dec.embedding(blank))
            self._start = (h0, c0, dec.decoder_projector(out[:, 0]))
        self.h = torch.zeros(layers, slots, hidden, device=dev, dtype=dt)
        self.c = torch.zeros_like(self.h)
        self.d = torch.zeros(slots, hidden, device=dev, dtype=dt)

    def chunk_mel_frames(self, first: bool) -> int:
        return self.first_mel if first else self.next_mel

    @torch.inference_mode()
    def step(self, rows: list[Row]) -> list[list[int]]:
        """Encode one chunk per row and decode it; the new token ids of each row."""
        if not rows:
            return []
        idx = torch.tensor([r.slot for r in rows], device=self.device)
        first = torch.tensor([r.first for r in rows], device=self.device)
        keep = torch.tensor([r.keep for r in rows], device=self.device)
        embeds = self._subsample(rows, idx)
        frames = self._conformer(embeds, idx, first, keep)
        return self._decode(frames, idx, first, keep)

    def _subsample(self, rows: list[Row], idx: torch.Tensor) -> torch.Tensor:
        """The convolutional subsampling of each row's chunk: (B, r + 1, hidden)."""
        enc = self.model.encoder
        out = torch.empty(len(rows), self.chunk_frames, enc.config.hidden_size, device=self.device, dtype=self.dtype)
        for want_first in (True, False):
            pick = [i for i, r in enumerate(rows) if r.first is want_first]
            if not pick:
                continue
            segments = torch.from_numpy(np.stack([rows[i].samples for i in pick]))
            feats = self.mel(segments)
            cache = self._padding_cache_type()
            at = torch.tensor(pick, device=self.device)
            slots = idx[at]
            if not want_first:
                for key, state in self.subsampling.items():
                    layer = cache.layers[key] = _steady_conv2d_layer(state[slots])
                    layer.left_pad = state.shape[2]
            embeds = enc.subsampling(feats, None, padding_cache=cache)
            kept = torch.tensor([rows[i].keep for i in pick], device=self.device)
            for key, layer in cache.layers.items():
                if key not in self.subsampling:
                    shape = (self.slots, *layer.cache.shape[1:])
                    self.subsampling[key] = torch.zeros(shape, device=self.device, dtype=self.dtype)
                self.subsampling[key][slots[kept]] = layer.cache[kept]
            out[at] = embeds * enc.input_scale
        return out

    def _conformer(self, x: torch.Tensor, idx: torch.Tensor, first: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        enc = self.model.encoder
        q, w = self.chunk_frames, self.window
        seen = torch.where(first, 0, self.seen[idx])
        # Row b's query frames see: its real window frames (the last seen[b] of w) and its own chunk.
        kv = torch.arange(w + q, device=self.device)
        allowed = (kv[None, :] >= w - seen[:, None]) | (kv[None, :] >= w)
        mask = allowed[:, None, None, :].expand(-1, 1, q, -1)
        fresh = first[:, None, None, None]
        keys = [torch.where(fresh, 0, k[idx]) for k in self.keys]
        values = [torch.where(fresh, 0, v[idx]) for v in self.values]
        kvw = _KvWindow(keys, values, w)
        conv = _ConvCache({key: torch.where(first[:, None, None], 0, c[idx]) for key, c in self.conv.items()})
        positions = enc.encode_positions(x, cached_frames=w)
        for layer in enc.layers:
            x = layer(x, attention_mask=mask, position_embeddings=positions, past_key_values=kvw, padding_cache=conv)
        kept = idx[keep]
        for i in range(len(self.keys)):
            self.keys[i][kept] = kvw.keys[i][keep]
            self.values[i][kept] = kvw.values[i][keep]
        for key, c in conv.caches.items():
            self.conv[key][kept] = c[keep]
        self.seen[kept] = torch.clamp(seen[keep] + q, max=w)
        out: torch.Tensor = self.model.encoder_projector(x)
        return out

    def _decode(self, frames: torch.Tensor, idx: torch.Tensor, first: torch.Tensor, keep: torch.Tensor) -> list[list[int]]:
        """Greedy RNN-T over the chunk's frames for every row at once."""
        model, dec = self.model, self.model.decoder
        h0, c0, d0 = self._start
        fresh = first[None, :, None]
        h = torch.where(fresh, h0, self.h[:, idx])
        c = torch.where(fresh, c0, self.c[:, idx])
        d = torch.where(first[:, None], d0[0], self.d[idx])
        emitted: list[torch.Tensor] = []
        for t in range(frames.shape[1]):
            f = frames[:, t]
            active = torch.ones(len(idx), dtype=torch.bool, device=self.device)
            for _ in range(self.max_symbols):
                k = model.joint(d, f).argmax(-1)
                emit = active & (k != self.blank)
                if not bool(emit.any()):
                    break
                out, (h2, c2) = dec.lstm(dec.embedding(k)[:, None], (h, c))
                d = torch.where(emit[:, None], dec.decoder_projector(out[:, 0]), d)
                h = torch.where(emit[None, :, None], h2, h)
                c = torch.where(emit[None, :, None], c2, c)
                emitted.append(torch.where(emit, k, -1))
                active = emit
        kept = idx[keep]
        self.h[:, kept], self.c[:, kept], self.d[kept] = h[:, keep], c[:, keep], d[keep]
        if not emitted:
            return [[] for _ in range(len(idx))]
        table = torch.stack(emitted, 1).cpu().tolist()
        return [[k for k in row if k >= 0] for row in table]


def _steady_conv2d_layer(cache: torch.Tensor) -> Any:
    """A subsampling conv cache layer that has seen a chunk already (no first-chunk padding)."""
    from transformers.models.nemotron_asr_streaming.modeling_nemotron_asr_streaming import (
        NemotronAsrStreamingEncoderCausalConv2dCacheLayer,
    )

    layer = NemotronAsrStreamingEncoderCausalConv2dCacheLayer()
    layer.cache = cache
    layer.init_pad = 0
    layer.is_first_chunk = False
    layer.is_initialized = True
    return layer


# -- loading ---------------------------------------------------------------------------------


def load_model(path: str, device: str, dtype: str) -> Any:
    """``NemotronAsrStreamingForRNNT`` from a directory or hub id, in eval mode on ``device``."""
    from transformers import NemotronAsrStreamingForRNNT

    model = NemotronAsrStreamingForRNNT.from_pretrained(path, dtype=getattr(torch, dtype))
    model.config.encoder_config._attn_implementation = "sdpa"
    model = model.to(device).eval().requires_grad_(False)
    # The prediction network's LSTM, moved to the GPU, keeps weights that are not one
    # contiguous chunk: cuDNN then compacts them at every call (and warns each time).
    for module in model.modules():
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()
    return model


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def random_model(*, tiny: bool, seed: int = 0) -> tuple[Any, list[str]]:
    """A model with random weights -- the real shape (Nemotron Speech Streaming EN 0.6B, 618 M
    parameters) or a tiny one (two layers, 64 wide) -- and its word-level vocabulary."""
    from transformers import NemotronAsrStreamingConfig, NemotronAsrStreamingForRNNT

    words = [f"▁{w}" for w in _WORDS] + list("s.,?")
    if tiny:
        vocab = ["<unk>", *words]
        enc = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
               "subsampling_conv_channels": 16, "num_mel_bins": 128}
        cfg = NemotronAsrStreamingConfig(encoder_config=enc, decoder_hidden_size=32, vocab_size=len(vocab) + 1,
                                         blank_token_id=len(vocab))
    else:
        vocab = ["<unk>", *words, *(f"▁w{i}" for i in range(1023 - len(words)))]
        cfg = NemotronAsrStreamingConfig(encoder_config={"num_mel_bins": 128})
    torch.manual_seed(seed)
    model = NemotronAsrStreamingForRNNT(cfg).eval()
    model.config.encoder_config._attn_implementation = "sdpa"
    if tiny:
        # The checkpoint's init (std 0.02) makes every encoder frame alike and every frame
        # emit the same symbols: weights scaled to their fan-in, the encoder's side of the
        # joint louder than the prediction network's, make the output follow the audio; two
        # symbols a frame at most and a blank bias make it sparse, like speech.
        model.config.max_symbols_per_step = model.max_symbols_per_step = 2
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, p[0].numel() ** -0.5)
            for p in model.encoder_projector.parameters():
                p.mul_(5.0)
            for p in model.decoder.decoder_projector.parameters():
                p.mul_(0.2)
            model.joint.head.bias[cfg.blank_token_id] += 1.0
    return model.requires_grad_(False), vocab


def build_random_model(out: Path, *, tiny: bool, seed: int = 0) -> Path:
    """:func:`random_model` and a word-level tokenizer of its vocabulary, saved as a model
    directory published as ``out`` by rename (``out/random.json`` marks it complete)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, vocab = random_model(tiny=tiny, seed=seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp)
        (tmp / "random.json").write_text(json.dumps({"tiny": tiny, "seed": seed}))
        # Published by rename: a process that lost the race keeps the winner's copy.
        with contextlib.suppress(OSError):
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (out / "random.json").is_file():
        raise RuntimeError(f"{out} was not built")
    return out


_WORDS = ("the a and to of i you it is that what yes no hello hi please thanks can my your we "
          "how time now call help order book weather today tomorrow").split()


def chunk_layout(lookahead: int) -> tuple[int, int]:
    """Mel frames of the first chunk and of every later one for a lookahead of ``r`` frames."""
    return 1 + SUBSAMPLING * lookahead, SUBSAMPLING * (lookahead + 1)


def frames_to_cover(samples: int, lookahead: int) -> int:
    """Mel frames the final encodes: every frame centred in the audio, rounded up to whole chunks."""
    first, per = chunk_layout(lookahead)
    need = max(1, math.ceil(samples / HOP))
    return first if need <= first else first + math.ceil((need - first) / per) * per
