"""Coqui model directories with random weights for tests (no Coqui weights can be
fetched here), and what the Coqui engine tests share. The VITS: ``benchmarks/coqui_random.py
--tiny``, loaded by path; every token lasts exactly ``FRAMES`` frames of ``HOP`` samples, so
a sentence's length is known from its token count. The XTTS: :func:`tiny_xtts`. Random
weights make noise, not speech."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import bench_scripts

if TYPE_CHECKING:
    from voicebot.engines.tts.coqui import CoquiTts

FRAMES = 3  # ceil of coqui_random.FRAMES_PER_TOKEN
HOP = 256
RATE = 22_050


def builder() -> ModuleType:
    return bench_scripts.load("coqui_random")


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


# The tiny XTTS: GPT tokens a sentence makes (the stop token never wins) and the audio each
# token decodes to at 24 kHz (1,024 samples at 22,050 Hz in the GPT's frame, resampled).
XTTS_TOKENS = 16
XTTS_RATE = 24_000


def tiny_xtts(out: Path) -> Path:
    """A random-weight XTTS(-v2) model directory built from Coqui's own ``XttsConfig``: a
    one-layer GPT of width 32 over 66 audio codes, XTTS's HiFi-GAN decoder and speaker
    encoder at their real (fixed) size, and a ``vocab.json`` made from the Tortoise BPE
    tokenizer coqui-tts ships, with the two tokens XTTS adds (``[START]``, ``[en]``).

    Every sentence is exactly ``XTTS_TOKENS`` GPT tokens: the stop code's logit is pinned
    far down, so generation runs to the model's limit. ``top_k`` 1 makes the tokens the
    argmax, so a sentence in one voice is the same audio every time and another reference
    clip changes it. Random weights make noise, not speech. Builds in a couple of seconds;
    ``model.pth`` is about 90 MB (the decoder's size is not configurable)."""
    import torch
    import TTS
    from tokenizers import Tokenizer
    from TTS.tts.configs.xtts_config import XttsArgs, XttsConfig
    from TTS.tts.layers.xtts.tokenizer import VoiceBpeTokenizer
    from TTS.tts.models.xtts import Xtts

    out.mkdir(parents=True, exist_ok=True)
    shipped = Path(TTS.__file__).parent / "tts" / "utils" / "assets" / "tortoise" / "tokenizer.json"
    vocab = Tokenizer.from_file(str(shipped))
    vocab.add_special_tokens(["[START]", "[en]"])
    vocab.save(str(out / "vocab.json"))
    # max_gen_mel_tokens is gpt_max_audio_tokens - 3 (one conditioning input, start and stop).
    args = XttsArgs(gpt_layers=1, gpt_n_model_channels=32, gpt_n_heads=2, decoder_input_dim=32,
                    gpt_max_audio_tokens=XTTS_TOKENS + 3, gpt_num_audio_tokens=66, gpt_start_audio_token=64,
                    gpt_stop_audio_token=65)
    config = XttsConfig(model_args=args, languages=["en"], top_k=1)
    config.audio.output_sample_rate = XTTS_RATE
    torch.manual_seed(0)
    model = Xtts(config)
    model.tokenizer = VoiceBpeTokenizer(vocab_file=str(out / "vocab.json"))
    model.init_models()  # the GPT's text vocabulary comes from the tokenizer
    with torch.no_grad():
        model.gpt.mel_head.bias[args.gpt_stop_audio_token] = -1e4
    config.save_json(str(out / "config.json"))
    torch.save({"model": model.state_dict()}, out / "model.pth")
    return out


async def jobs_when_closed_at_the_first_chunk(tts: CoquiTts, text: str) -> int:
    """Take ``text``'s first chunk, close the stream, wait until no synthesis runs: how many
    of the engine's pool jobs ran or were dropped meanwhile (one chunk a job)."""
    pool = tts.pool
    before = pool.completed + pool.discarded + pool.dropped
    async with contextlib.aclosing(tts.synthesize(text)) as stream:
        first = await asyncio.wait_for(anext(stream), 120)
        assert first.size > 0
    async with asyncio.timeout(60):
        while pool.running:
            await asyncio.sleep(0.01)
    assert tts.queue_depth == 0
    return pool.completed + pool.discarded + pool.dropped - before
