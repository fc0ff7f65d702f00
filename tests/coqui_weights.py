"""A Coqui VITS model directory with random weights for tests (no Coqui weights can be
fetched here): ``benchmarks/coqui_random.py --tiny``, loaded by path. Random weights make
noise, not speech; every token lasts exactly ``FRAMES`` frames of ``HOP`` samples, so a
sentence's length is known from its token count."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
FRAMES = 3  # ceil of coqui_random.FRAMES_PER_TOKEN
HOP = 256
RATE = 22_050


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("coqui_random", ROOT / "benchmarks" / "coqui_random.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_vits(out: Path, speakers: list[str] | None = None) -> Path:
    """Build the tiny random VITS model into ``out`` (about 1 MB, a few seconds);
    ``speakers``: a multi-speaker one."""
    return Path(builder().build(out, tiny=True, speakers=speakers))


def tokens(model_dir: Path, sentence: str) -> int:
    """How many tokens the model's own tokenizer makes of ``sentence`` (blanks included)."""
    from TTS.config import load_config
    from TTS.tts.utils.text.tokenizer import TTSTokenizer

    tokenizer, _ = TTSTokenizer.init_from_config(load_config(str(model_dir / "config.json")))
    return len(tokenizer.text_to_ids(sentence))
