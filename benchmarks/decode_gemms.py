"""Where one CPU decode step of the LLM goes: each weight's matrix product at batch 1.

    python benchmarks/decode_gemms.py --json artifacts/decode_gemms.json

Times vLLM's own CPU GEMM (oneDNN, the handle it builds for each unquantised linear
layer) for every weight shape of the model in ``--model`` (config.json: hidden and
intermediate sizes, heads, layers, vocabulary), one token at a time, with one random
weight per layer so that they stream from memory as in a real step, and sums them per
step. Also times the output projection cut to the rows of Latin-script tokens (the
``is_latin`` rule below), the ceiling of what computing only those would save.
docs/benchmarks.md ("Issue 12 §4: what a decode step is made of") has the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_util import summarise  # noqa: E402

DEFAULT_MODEL = Path(os.path.expanduser("~/.cache/voicebot/models/qwen2.5-0.5b-instruct"))


def is_latin(text: str) -> bool:
    """Printable ASCII, whitespace, Latin-1 and Latin Extended-A, typographic quotes and
    dashes; U+FFFD (a piece of a multi-byte character decoded alone) passes."""
    return bool(text) and all(
        0x20 <= ord(c) < 0x7F or c in "\n\t\r\ufffd" or 0xA0 <= ord(c) <= 0x17F or 0x2010 <= ord(c) <= 0x2026
        for c in text
    )


def latin_rows(model: Path, vocab: int) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    added = set(tok.get_added_tokens_decoder())
    n = min(tok.get_vocab_size(with_added_tokens=True), vocab)
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return sum(1 for i in range(n) if i in added or is_latin(texts[i]))


def time_gemm(rows: int, cols: int, runs: int, copies: int = 1) -> list[float]:
    """Seconds per product of a (1 x cols) activation with a (rows x cols) float32 weight.
    With ``copies``, each run goes through that many distinct weights (a model's layers)
    and the time is per weight: the weights stream from memory as in a real step, instead
    of one weight staying in the cache."""
    import torch
    from vllm import _custom_ops as ops

    handles = [ops.create_onednn_mm(torch.randn(rows, cols).t(), 32) for _ in range(copies)]
    x = torch.randn(1, cols)
    for h in handles:
        ops.onednn_mm(h, x, None)
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        for h in handles:
            ops.onednn_mm(h, x, None)
        out.append((time.perf_counter() - t) / copies)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    cfg = json.loads((args.model / "config.json").read_text())
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    kept = latin_rows(args.model, vocab)
    shapes = {
        "qkv_proj": (cfg["num_attention_heads"] * head_dim + 2 * kv, h),
        "o_proj": (h, cfg["num_attention_heads"] * head_dim),
        "gate_up_proj": (2 * inter, h),
        "down_proj": (h, inter),
        "lm_head": (vocab, h),
        "lm_head_latin": (kept, h),
    }
    result: dict[str, object] = {"model": str(args.model), "threads": args.threads, "layers": layers, "latin_rows": kept}
    per: dict[str, float] = {}
    for name, (rows, cols) in shapes.items():
        s = summarise(time_gemm(rows, cols, args.runs, 1 if name.startswith("lm_head") else layers), digits=2)
        result[name] = {"rows": rows, "cols": cols, "mb": round(rows * cols * 4 / 1e6, 1), **s}
        per[name] = s["p50"]
        print(f"{name:14s} {rows:7d} x {cols:5d}  {rows * cols * 4 / 1e6:7.1f} MB  p50 {s['p50']:7.2f} ms")
    layer = per["qkv_proj"] + per["o_proj"] + per["gate_up_proj"] + per["down_proj"]
    result["step_ms"] = {"layers": round(layer * layers, 1), "lm_head": per["lm_head"], "lm_head_latin": per["lm_head_latin"]}
    print(f"per step: {layers} layers {layer * layers:.1f} ms + lm_head {per['lm_head']:.1f} ms "
          f"({per['lm_head_latin']:.1f} ms over the {kept} Latin-script rows)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
