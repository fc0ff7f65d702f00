"""A tiny streaming FastConformer + RNN-T with random weights for tests (no checkpoint can
be fetched here): two conformer layers, 64 wide, a word-level tokenizer of a few dozen words
(``fastconformer_model.build_random_model``). Built once into
``<cache_dir>/testdata/fastconformer-tiny``, loaded by path like a real checkpoint. Random
weights make words of noise, not a transcript: tests compare it with itself (streamed
against the reference forward over the whole utterance)."""

from __future__ import annotations

import functools
from pathlib import Path

from voicebot.config import Config
from voicebot.provision.build import cache_root


@functools.cache
def tiny_fastconformer_dir() -> Path:
    from voicebot.engines.asr.fastconformer_model import build_random_model

    dest = cache_root(Config().models) / "testdata" / "fastconformer-tiny"
    if (dest / "random.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    return build_random_model(dest, tiny=True)
