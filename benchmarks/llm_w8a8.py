"""int8 weights for the CPU LLM (W8A8): does reading fewer bytes per token decode faster?

    python benchmarks/llm_w8a8.py --out artifacts/w8a8/model            # linear layers only
    python benchmarks/llm_w8a8.py --out artifacts/w8a8/model-head --lm-head
    python benchmarks/engines.py --only llm --set llm.model=artifacts/w8a8/model --json OUT.json

Writes a copy of a model directory (default: the offline default LLM) whose linear layers
are int8 with one float32 scale per output row, in the compressed-tensors format vLLM loads
as W8A8 (activations quantised per token at run time; oneDNN int8 kernels on x86). Decoding
a 0.5B model reads every weight for every token, so int8 reads a quarter of float32's bytes;
docs/benchmarks.md ("int8 weights") has what it measured: slower on an AVX2-only CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantization_config(lm_head: bool) -> dict[str, object]:
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear", "lm_head"] if lm_head else ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        }},
        "ignore": [] if lm_head else ["lm_head"],
    }


def quantize(src: Path, out: Path, lm_head: bool) -> int:
    import torch
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    done = 0
    for name in list(state):
        parts = name.split(".")
        if parts[-1] != "weight" or not (parts[-2] in LINEAR or (lm_head and name == "lm_head.weight")):
            continue
        w = state[name].float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0  # symmetric, per row
        state[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8).contiguous()
        state[name.removesuffix("weight") + "weight_scale"] = scale.contiguous()
        done += 1
    write_copy(src, out, state, quantization_config(lm_head))
    return done


def write_copy(src: Path, out: Path, state: dict, quantization: dict[str, object]) -> None:
    """``out``: ``src`` with these weights and this quantization_config in its config.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():  # tokenizer, chat template, generation config
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "voicebot-manifest.json"):
            shutil.copy(f, out / f.name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundle:qwen2.5-0.5b-instruct")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lm-head", action="store_true", help="quantise lm_head too")
    args = p.parse_args()
    from voicebot.config import load_config
    from voicebot.provision import resolve_model

    src = Path(resolve_model(args.model, load_config(args.config).models))
    n = quantize(src, args.out, args.lm_head)
    size = (args.out / "model.safetensors").stat().st_size / 1e9
    print(f"{n} linear layers as int8 -> {args.out} ({size:.2f} GB of weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
