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
for all (distances from the chunk), so a stream's output is the one it would get alone. A
stream's first chunk (one mel frame plus ``8 r``, the others ``8 (r + 1)``) runs in the
steady chunk's shape, its leading frames standing for the padding its convolutions would add.

Each step encodes a chunk of ``r + 1`` encoder frames (``(r + 1) * 80`` ms) per stream, every
audio frame once, then decodes those frames greedily for all streams at once (up to
``max_symbols_per_step`` symbols a frame, as transformers' ``generate``). Its shapes depend
only on the number of rows and it waits for the device once, for its tokens: padded to a few
row counts, it is captured as CUDA graphs (``asr.fastconformer.cuda_graphs``).

Features are the model's log-mel (pre-emphasis, 25 ms Hann window in a 512-point FFT, 10 ms
hop, Slaney mel, log with a 2^-24 floor, no normalisation), computed per chunk exactly as a
``center=True`` pass over the whole utterance would (:func:`log_mel`): a stream keeps the
pre-emphasised samples it still needs, left-padded with half an FFT of zeros.

This module imports torch and transformers only (and :mod:`voicebot.engines.cuda_graphs`, torch
only): a benchmark runs it on a bare GPU machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
from collections.abc import Sequence
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

    The step has fixed shapes for a given row count and no host sync until its tokens are
    read: first chunks run in the steady chunk's shape (:class:`_SubsamplingCache`), the
    greedy decode runs ``max_symbols_per_step`` symbol iterations per frame for every row,
    masked, and rows write their state through an index (a row that keeps none -- a final's
    padded last chunk, or a padding row -- writes to one spare slot nobody reads). With
    ``buckets`` the rows are padded to the next of those counts, so a few shapes serve every
    step; with ``cuda_graphs`` (``buckets`` default to :func:`step_buckets`) each count's step
    is captured once as a CUDA graph and replayed. The captured function is the one that runs
    eagerly otherwise.
    """

    def __init__(
        self,
        model: Any,
        slots: int,
        lookahead: int,
        *,
        buckets: Sequence[int] | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.slots = slots
        self.lookahead = lookahead
        enc_cfg = model.config.encoder_config
        self.chunk_frames = lookahead + 1  # encoder frames per chunk
        self.first_mel, self.next_mel = chunk_layout(lookahead)
        self.step_samples = samples_for(self.next_mel)  # every row's samples in a step
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
        self.spare = slots  # the slot that rows keeping no state write to
        n = slots + 1
        self.keys = [torch.zeros(n, heads, self.window, head_dim, device=dev, dtype=dt) for _ in enc.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.seen = torch.zeros(n, dtype=torch.long, device=dev)  # real frames in the window
        self.conv = {
            f"conv.{i}": torch.zeros(n, enc_cfg.hidden_size, layer.conv.depthwise_conv.left_pad, device=dev, dtype=dt)
            for i, layer in enumerate(enc.layers)
        }
        convs = [enc.subsampling.conv_in, *(layer.depthwise_conv for layer in enc.subsampling.layers)]
        self._lead = _first_chunk_lead(convs, self.next_mel - self.first_mel)
        dec = model.decoder
        layers, hidden = model.config.num_decoder_layers, model.config.decoder_hidden_size
        with torch.inference_mode():
            # One steady chunk through the subsampling shapes its convolution caches.
            probe = _SubsamplingCache({}, self._lead, torch.ones(1, dtype=torch.bool, device=dev))
            enc.subsampling(torch.zeros(1, self.next_mel, enc_cfg.num_mel_bins, device=dev, dtype=dt), None,
                            padding_cache=probe)
            blank = torch.full((1, 1), self.blank, dtype=torch.long, device=dev)
            out, (h0, c0) = dec.lstm(dec.embedding(blank))
            self._start = (h0, c0, dec.decoder_projector(out[:, 0]))
        self.subsampling = {key: torch.zeros(n, *s.shape[1:], device=dev, dtype=dt) for key, s in probe.states.items()}
        self.h = torch.zeros(layers, n, hidden, device=dev, dtype=dt)
        self.c = torch.zeros_like(self.h)
        self.d = torch.zeros(n, hidden, device=dev, dtype=dt)
        if cuda_graphs and buckets is None:
            buckets = step_buckets(slots)
        self.buckets = sorted(set(buckets)) if buckets is not None else None
        if self.buckets is not None and (self.buckets[0] < 1 or self.buckets[-1] < slots):
            raise ValueError(f"step buckets {self.buckets} must be positive and reach {slots} rows")
        self._graphs: dict[int, Any] = {}  # rows -> cuda_graphs.CapturedCall
        self._staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rows -> pinned host inputs
        if cuda_graphs:
            self._capture()

    def chunk_mel_frames(self, first: bool) -> int:
        return self.first_mel if first else self.next_mel

    def rows_for(self, n: int) -> int:
        """The rows a step of ``n`` streams runs: the next bucket, or ``n`` without buckets."""
        if self.buckets is None:
            return n
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def step(self, rows: list[Row]) -> list[list[int]]:
        """Encode one chunk per row and decode it; the new token ids of each row."""
        if not rows:
            return []
        if len(rows) > self.slots:
            raise ValueError(f"{len(rows)} rows for {self.slots} slots")
        size = self.rows_for(len(rows))
        graph = self._graphs.get(size)
        if graph is not None:
            samples, meta = self._staging[size]
            self._fill(rows, samples.numpy(), meta.numpy())
            emitted = graph(samples, meta)
        else:
            samples_np = np.empty((size, self.step_samples), np.float32)
            meta_np = np.empty((3, size), np.int64)
            self._fill(rows, samples_np, meta_np)
            emitted = self._forward(torch.from_numpy(samples_np).to(self.device), torch.from_numpy(meta_np).to(self.device))
        table = emitted[: len(rows)].cpu().tolist()  # the step's one wait for the device
        return [[k for k in row if k >= 0] for row in table]

    def _fill(self, rows: list[Row], samples: np.ndarray, meta: np.ndarray) -> None:
        """The step's inputs: each row's samples right-aligned (a first chunk is shorter),
        and per row its slot, the slot its state goes to, and whether it starts afresh.
        Padding rows start afresh and write to the spare slot."""
        samples[:] = 0.0
        meta[0], meta[1], meta[2] = self.spare, self.spare, 1
        for i, row in enumerate(rows):
            samples[i, self.step_samples - row.samples.size :] = row.samples
            meta[0, i] = row.slot
            meta[1, i] = row.slot if row.keep else self.spare
            meta[2, i] = row.first

    def _forward(self, samples: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """The whole step on device tensors of fixed shapes: (B, step_samples) samples and
        (3, B) slots / write slots / first flags in; (B, frames x max_symbols) token ids out,
        -1 where nothing was emitted. What a CUDA graph captures."""
        slot, write, first = meta[0], meta[1], meta[2].bool()
        embeds = self._subsample(self.mel(samples), slot, write, first)
        frames = self._conformer(embeds, slot, write, first)
        return self._decode(frames, slot, write, first)

    def _subsample(self, feats: torch.Tensor, slot: torch.Tensor, write: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The convolutional subsampling of each row's chunk: (B, r + 1, hidden)."""
        enc = self.model.encoder
        fresh = first[:, None, None, None]
        states = {key: torch.where(fresh, 0, s[slot]) for key, s in self.subsampling.items()}
        cache = _SubsamplingCache(states, self._lead, first)
        embeds = enc.subsampling(feats, None, padding_cache=cache)
        for key, s in self.subsampling.items():
            s.index_copy_(0, write, cache.states[key])
        out: torch.Tensor = embeds * enc.input_scale
        return out

    def _conformer(self, x: torch.Tensor, slot: torch.Tensor, write: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        enc = self.model.encoder
        q, w = self.chunk_frames, self.window
        seen = torch.where(first, 0, self.seen[slot])
        # Row b's query frames see: its real window frames (the last seen[b] of w) and its own chunk.
        kv = torch.arange(w + q, device=self.device)
        allowed = (kv[None, :] >= w - seen[:, None]) | (kv[None, :] >= w)
        mask = allowed[:, None, None, :].expand(-1, 1, q, -1)
        fresh = first[:, None, None, None]
        keys = [torch.where(fresh, 0, k[slot]) for k in self.keys]
        values = [torch.where(fresh, 0, v[slot]) for v in self.values]
        kvw = _KvWindow(keys, values, w)
        conv = _ConvCache({key: torch.where(first[:, None, None], 0, c[slot]) for key, c in self.conv.items()})
        positions = enc.encode_positions(x, cached_frames=w)
        for layer in enc.layers:
            x = layer(x, attention_mask=mask, position_embeddings=positions, past_key_values=kvw, padding_cache=conv)
        for i in range(len(self.keys)):
            self.keys[i].index_copy_(0, write, kvw.keys[i])
            self.values[i].index_copy_(0, write, kvw.values[i])
        for key, c in conv.caches.items():
            self.conv[key].index_copy_(0, write, c)
        self.seen.index_copy_(0, write, torch.clamp(seen + q, max=w))
        out: torch.Tensor = self.model.encoder_projector(x)
        return out

    def _decode(self, frames: torch.Tensor, slot: torch.Tensor, write: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Greedy RNN-T over the chunk's frames for every row at once: per frame,
        ``max_symbols`` symbol iterations, a row emitting until its first blank and idle,
        masked, through the rest (no host sync to stop early). The tokens as
        (B, frames x max_symbols), -1 where none."""
        model, dec = self.model, self.model.decoder
        h0, c0, d0 = self._start
        fresh = first[None, :, None]
        h = torch.where(fresh, h0, self.h[:, slot])
        c = torch.where(fresh, c0, self.c[:, slot])
        d = torch.where(first[:, None], d0[0], self.d[slot])
        emitted: list[torch.Tensor] = []
        for t in range(frames.shape[1]):
            f = frames[:, t]
            active = torch.ones_like(first)
            for _ in range(self.max_symbols):
                k = model.joint(d, f).argmax(-1)
                emit = active & (k != self.blank)
                out, (h2, c2) = dec.lstm(dec.embedding(k)[:, None], (h, c))
                d = torch.where(emit[:, None], dec.decoder_projector(out[:, 0]), d)
                h = torch.where(emit[None, :, None], h2, h)
                c = torch.where(emit[None, :, None], c2, c)
                emitted.append(torch.where(emit, k, -1))
                active = emit
        self.h.index_copy_(1, write, h)
        self.c.index_copy_(1, write, c)
        self.d.index_copy_(0, write, d)
        return torch.stack(emitted, 1)

    def _capture(self) -> None:
        """One CUDA graph per bucket, the largest first (the smaller ones fit in its memory
        pool). The warm-up runs every row as a padding row: the slots are untouched."""
        from voicebot.engines.cuda_graphs import CapturedCall

        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {self.device}")
        assert self.buckets is not None
        stream = torch.cuda.Stream(self.device)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.buckets):
                samples = torch.zeros(size, self.step_samples, device=self.device)
                meta = torch.tensor([[self.spare] * size, [self.spare] * size, [1] * size], device=self.device)
                self._graphs[size] = CapturedCall(self._forward, (samples, meta), stream=stream, pool=pool)
                self._staging[size] = (torch.zeros(size, self.step_samples).pin_memory(),
                                       torch.zeros(3, size, dtype=torch.long).pin_memory())


class _SubsamplingCache:
    """The convolutional subsampling's causal caches for one step (the ``padding_cache`` of
    its convolutions' ``update`` protocol), every row in the steady chunk's shape.

    A stream's first chunk is shorter than the others (its convolutions pad it on the left
    instead of reading a cache). It runs here as a steady chunk whose leading ``lead[key]``
    frames are zeroed at every convolution: with a fresh (zero) cache that is exactly the
    first chunk's own padding, and the outputs are the first chunk's (:func:`_first_chunk_lead`),
    so one shape serves both kinds of rows."""

    def __init__(self, states: dict[str, torch.Tensor], lead: dict[str, int], first: torch.Tensor) -> None:
        self.states, self.lead, self.first = states, lead, first

    def update(self, hidden: torch.Tensor, key: str, conv: nn.Module) -> torch.Tensor:
        zeros = self.lead[key]
        if zeros:
            frame = torch.arange(hidden.shape[2], device=hidden.device)
            hidden = hidden.masked_fill(self.first[:, None, None, None] & (frame < zeros)[None, None, :, None], 0.0)
        state = self.states.get(key)
        if state is None:  # shaping the slots' caches (SlotPool.__init__)
            state = hidden.new_zeros(hidden.shape[0], hidden.shape[1], int(conv.left_pad), hidden.shape[3])
        self.states[key] = hidden[:, :, hidden.shape[2] - state.shape[2] :]
        return torch.cat([state, hidden], dim=2)


def step_buckets(slots: int) -> list[int]:
    """Row counts a step is padded to: powers of two and the halfway points between them
    (1, 2, 3, 4, 6, 8, 12 ...) below ``slots``, and ``slots``: padding wastes at most a
    third of a step, with two shapes per doubling of streams."""
    out, b = {slots}, 1
    while b < slots:
        out |= {b, b + b // 2}
        b *= 2
    return sorted(x for x in out if x <= slots)


def _first_chunk_lead(convs: list[Any], zeros: int) -> dict[str, int]:
    """Per subsampling convolution (by cache key), how many leading frames of a first chunk
    run in the steady shape stand for the first chunk's own left padding: ``zeros`` mel
    frames at the first convolution. A fresh cache and ``z`` zeroed frames put the real
    frames ``z + 1 - s`` frames later than the first chunk's padding would (a stride-``s``
    convolution pads a first chunk with ``kernel - 1`` frames, a steady one reads
    ``kernel - s`` cached): that is ``(z + 1) / s - 1`` whole outputs, zeroed in turn at the
    next convolution, and none may be left at the end."""
    lead = {}
    for conv in convs:
        lead[conv.cache_key] = zeros
        stride = conv.stride[0]
        if (zeros + 1) % stride or conv.left_pad_init - conv.left_pad != stride - 1:
            raise ValueError(f"a first chunk cannot run in the steady shape through {conv.cache_key}")
        zeros = (zeros + 1) // stride - 1
    if zeros:
        raise ValueError("a first chunk in the steady shape leaves padding frames after the subsampling")
    return lead


# -- loading ---------------------------------------------------------------------------------


def load_model(path: str, device: str, dtype: str) -> Any:
    """``NemotronAsrStreamingForRNNT`` from a directory or hub id, in eval mode on ``device``."""
    from transformers import NemotronAsrStreamingForRNNT

    return ready(NemotronAsrStreamingForRNNT.from_pretrained(path, dtype=getattr(torch, dtype)), device, dtype)


def ready(model: Any, device: str, dtype: str) -> Any:
    """``model`` in eval mode on ``device`` in ``dtype``, with SDPA attention."""
    model.config.encoder_config._attn_implementation = "sdpa"
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)
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
