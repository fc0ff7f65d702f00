"""Builders that write Hugging Face model directories vLLM loads.

- :func:`gguf_to_hf`: dequantise a GGUF (via transformers' ``gguf_file=``) into a bf16
  safetensors directory with its tokenizer and chat template;
- :func:`random_model`: a random-initialised model for a tokenizer already in the
  directory (a real-tokenizer test model that loads in seconds).

torch and transformers are imported inside the functions: listing or resolving models
must not pay for them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from voicebot.errors import BundleError

log = logging.getLogger(__name__)

# Written by transformers into tokenizer_config.json, meaningless for the saved copy.
_LOAD_TIME_KEYS = ("is_local", "local_files_only")


def _save_weights(model: Any, out: Path) -> None:
    from safetensors.torch import save_file

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        # Tied weights share storage, which save_file refuses; loaders re-tie from config.
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it 0600


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _tidy_tokenizer_config(out: Path, max_len: int) -> None:
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    for key in _LOAD_TIME_KEYS:
        data.pop(key, None)
    data["model_max_length"] = max_len
    _write_json(path, data)


def _has_chat_template(out: Path) -> bool:
    if (out / "chat_template.jinja").is_file():
        return True
    return bool(json.loads((out / "tokenizer_config.json").read_text()).get("chat_template"))


def gguf_to_hf(gguf: Path, out: Path, convert: dict[str, Any], generation: dict[str, Any]) -> None:
    """Convert ``gguf`` into ``out``: model.safetensors, config, tokenizer, chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, str(convert.get("dtype", "bfloat16")))
    src = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name,
           "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(**src)
    tokenizer.save_pretrained(str(out))
    # Dequantised straight to the target dtype: half the peak memory of a float32 load.
    model = AutoModelForCausalLM.from_pretrained(**src, dtype=dtype)
    config = model.config
    # The GGUF loader leaves architectures null and marks the config GGUF-quantised;
    # vLLM needs the class name and plain (unquantised) weights.
    config.architectures = [convert["architecture"]]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    _save_weights(model, out)
    config.save_pretrained(str(out))
    del model
    _tidy_tokenizer_config(out, int(getattr(config, "max_position_embeddings", 4096)))
    _write_json(out / "generation_config.json", generation)
    if not _has_chat_template(out):
        raise BundleError(f"{gguf.name}: the GGUF carries no chat template")


def random_model(out: Path, spec: dict[str, Any], generation: dict[str, Any], seed: int) -> None:
    """Random-initialise ``spec`` (a transformers config) beside the tokenizer in ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    params = dict(spec)
    dtype = getattr(torch, str(params.pop("torch_dtype", params.pop("dtype", "bfloat16"))))
    # Every token id must have an embedding row; pad like the real Qwen3 vocab does.
    params.setdefault("vocab_size", -(-len(tokenizer) // 128) * 128)
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    config.dtype = dtype
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _save_weights(model, out)
    config.save_pretrained(str(out))
    _write_json(out / "generation_config.json", generation)
    log.debug("random model: %d parameters, vocab %d",
              sum(p.numel() for p in model.parameters()), config.vocab_size)
