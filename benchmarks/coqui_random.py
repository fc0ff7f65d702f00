"""A Coqui VITS model directory with random weights, built from Coqui's own config: what the
tests and benchmarks/coqui_rtf.py load, since no Coqui weights can be fetched here.

    python benchmarks/coqui_random.py OUT_DIR [--tiny]

Without ``--tiny`` the model has the real shape of Coqui's LJSpeech VITS voice
(``tts_models/en/ljspeech/vits``: ``VitsConfig()``'s defaults, 22,050 Hz, hop 256,
espeak-ng phonemes); ``--tiny`` shrinks every layer, for tests that must load in a second.
Random weights make noise, not speech, and a random duration predictor makes utterances
of arbitrary length, so the plain duration predictor is used with every token's length
forced to ``--frames-per-token`` frames (ceil of 2.5: 3 frames, about 14 phonemes a second
with Coqui's blank tokens between them, a conversational rate). The output length is then
exact: ``tokens * 3 * 256`` samples at speed 1.

Writes ``config.json`` and ``model.pth`` (``{"model": state_dict}``, as Coqui's trainer).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

HOP = 256
FRAMES_PER_TOKEN = 2.5  # before ceil: exact 3.0 in float32 could round up to 4


def vits_config(*, tiny: bool) -> Any:
    from TTS.tts.configs.vits_config import VitsArgs, VitsConfig

    args = VitsArgs(use_sdp=False, init_discriminator=False)
    if tiny:
        args = VitsArgs(
            use_sdp=False, init_discriminator=False, hidden_channels=16, hidden_channels_ffn_text_encoder=32,
            num_layers_text_encoder=1, num_layers_posterior_encoder=1, num_layers_flow=1,
            upsample_initial_channel_decoder=16, resblock_kernel_sizes_decoder=[3],
            resblock_dilation_sizes_decoder=[[1, 3, 5]], out_channels=513)
    config = VitsConfig(model_args=args, use_phonemes=True, phonemizer="espeak", phoneme_language="en-us",
                        text_cleaner="phoneme_cleaners", add_blank=True)
    config.audio.sample_rate = 22_050
    config.audio.hop_length = HOP
    return config


def build(out: str | Path, *, tiny: bool = False, frames_per_token: float = FRAMES_PER_TOKEN, seed: int = 0,
          speakers: list[str] | None = None) -> Path:
    """Write a random-weight VITS model directory to ``out``; returns it. ``speakers``: a
    multi-speaker model with these names (``speaker_ids.json``, as Coqui's VCTK voice)."""
    import torch
    from TTS.tts.models.vits import Vits

    torch.manual_seed(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = vits_config(tiny=tiny)
    if speakers:
        ids = out / "speaker_ids.json"
        ids.write_text(json.dumps({name: i for i, name in enumerate(speakers)}))
        for section in (config, config.model_args):
            section.use_speaker_embedding = True
            section.num_speakers = len(speakers)
            section.speakers_file = str(ids)
    model = Vits(config)
    with torch.no_grad():  # every token lasts frames_per_token frames (the module docstring)
        model.duration_predictor.proj.weight.zero_()
        model.duration_predictor.proj.bias.fill_(math.log(frames_per_token))
    model.config.save_json(str(out / "config.json"))
    torch.save({"model": model.state_dict()}, out / "model.pth")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="model directory to write")
    ap.add_argument("--tiny", action="store_true", help="every layer shrunk (tests), not the real shape")
    ap.add_argument("--frames-per-token", type=float, default=FRAMES_PER_TOKEN)
    ap.add_argument("--speakers", nargs="*", help="speaker names: a multi-speaker model")
    args = ap.parse_args()
    print(build(args.out, tiny=args.tiny, frames_per_token=args.frames_per_token, speakers=args.speakers))


if __name__ == "__main__":
    main()
