"""What cutting Whisper's 30 s encoder window to the utterance would save on a GPU (issue 9).

The pipeline's cap on one GPU is the ASR final (docs/gpu-results.md): Whisper on vLLM
encodes a 30 s window for every decode, partial or final, however short the speech.
faster-whisper on the CPU already trims it (``asr.encoder_pad_s``); on vLLM that needs a
model/processor override. Before building it, this measures the prize: the encoder's
forward time per batch at 30 s and at shorter windows, with the real model's shape
(``--config``: a Hugging Face Whisper config.json) and random weights, in fp16.

A window of W seconds is W * 100 mel frames and W * 50 encoder positions; the encoder is
built with ``max_source_positions`` set to that, which is what a trimmed window computes
(the positional embedding sliced to the window). Only the encoder is timed: the decoder's
cross-attention over 1500 vs fewer positions is a small part of a decode.

    python benchmarks/gpu_whisper_window.py --config .gpu/whisper-turbo/config.json \\
        --windows 30 15 10 8 5 --batches 1 8 32 64 --json OUT.json
    # CPU smoke (figures mean nothing): --device cpu --dtype float32 --tiny --batches 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoder

FRAMES_PER_S = 100  # mel frames per second of audio (10 ms hop)


def encoder_for(cfg: WhisperConfig, window_s: float, device: str, dtype: torch.dtype) -> WhisperEncoder:
    c = WhisperConfig.from_dict(cfg.to_dict())
    c.max_source_positions = int(window_s * FRAMES_PER_S) // 2  # conv2 has stride 2
    with torch.device(device):
        enc = WhisperEncoder(c)
    return enc.to(dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_forward(enc: WhisperEncoder, batch: int, window_s: float, device: str, dtype: torch.dtype,
                 repeats: int, warmup: int) -> list[float]:
    feats = torch.randn(batch, enc.config.num_mel_bins, int(window_s * FRAMES_PER_S), device=device, dtype=dtype)
    times = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            sync(device)
            t0 = time.perf_counter()
            enc(feats)
            sync(device)
            if i >= warmup:
                times.append(1000 * (time.perf_counter() - t0))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="Whisper config.json (the real model's shape)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, d_model 64 shape instead (CPU smoke)")
    ap.add_argument("--windows", type=float, nargs="+", default=[30, 15, 10, 8, 5])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.tiny:
        cfg = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
                            decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=128, num_mel_bins=80)
    elif args.config:
        cfg = WhisperConfig.from_pretrained(str(Path(args.config).parent))
    else:
        ap.error("--config or --tiny")
    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    rows: list[dict[str, Any]] = []
    print(f"{device_name}, {args.dtype}, encoder layers {cfg.encoder_layers}, d_model {cfg.d_model}")
    print(f"{'window s':>8} {'batch':>5} {'p50 ms':>8} {'p95 ms':>8} {'ms/utt':>7} {'utt/s':>7} {'vs 30 s':>7}")
    base: dict[int, float] = {}
    for window in sorted(args.windows, reverse=True):
        enc = encoder_for(cfg, window, args.device, dtype)
        for batch in args.batches:
            try:
                t = time_forward(enc, batch, window, args.device, dtype, args.repeats, args.warmup)
            except torch.OutOfMemoryError:
                print(f"{window:8g} {batch:5d} out of memory")
                torch.cuda.empty_cache()
                continue
            p50 = statistics.median(t)
            p95 = sorted(t)[max(0, round(0.95 * len(t)) - 1)]
            if window == 30:
                base[batch] = p50
            ratio = p50 / base[batch] if batch in base else float("nan")
            row = {"window_s": window, "batch": batch, "p50_ms": round(p50, 2), "p95_ms": round(p95, 2),
                   "ms_per_utterance": round(p50 / batch, 3), "utterances_per_s": round(1000 * batch / p50, 1),
                   "vs_30s": round(ratio, 3)}
            rows.append(row)
            print(f"{window:8g} {batch:5d} {p50:8.1f} {p95:8.1f} {p50 / batch:7.2f} {1000 * batch / p50:7.1f} {ratio:7.2f}",
                  flush=True)
        del enc
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device_name, "dtype": args.dtype,
                                         "shape": {"encoder_layers": cfg.encoder_layers, "d_model": cfg.d_model},
                                         "weights": "random (speed does not depend on values)",
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
