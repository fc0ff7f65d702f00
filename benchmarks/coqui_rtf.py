"""What Coqui VITS costs per second of audio: the real-time factor of ``tts.engine: coqui``
(our ``CoquiTts``, one synthesis at a time) on a random-weight model of the real shape.

    python benchmarks/coqui_rtf.py --json OUT/coqui.json [--model DIR] [--device cpu] [--repeats 3]

No Coqui weights can be fetched here: without ``--model`` the script builds
``benchmarks/coqui_random.py``'s model of the shape of Coqui's LJSpeech VITS voice, every
token forced to 3 frames (about 14 phonemes a second, a conversational rate; the cost of a
forward follows the audio's length, not what it says). With ``--model`` it loads any Coqui
model directory (a real voice) the same way.

Each reply sentence of a short spoken dialogue is synthesised ``--repeats`` times, one
at a time, after one warm-up sentence; per sentence: synthesis seconds over audio seconds
(RTF, below 1 is faster than real time) and the time to its audio. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from typing import Any

from bench_util import (
    JSON_EPILOG,
    bare_engines_package,
    pct,
    run_with_deadline,
    summarise,
    write_result,
)

bare_engines_package()

from voicebot.config import TtsConfig  # noqa: E402

SENTENCES = [
    "Sure, I can help with that.",
    "Your train leaves from platform four at ten past nine.",
    "The next one is at half past, and it is usually less crowded.",
    "Would you like me to book a seat for you?",
    "Okay, done.",
    "Is there anything else you need for your trip today?",
    "Bicycles are allowed on this route, but you need a free reservation.",
    "Have a good journey.",
]


async def measure(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    from voicebot.engines.tts.coqui import CoquiTts

    t0 = time.perf_counter()
    tts = CoquiTts(TtsConfig(engine="coqui", coqui_model=model_dir, device=args.device, workers=1), model_dir)
    await tts.start()
    load_s = time.perf_counter() - t0
    rtfs: list[float] = []
    synth_s: list[float] = []
    audio_s = 0.0
    try:
        async for _ in tts.synthesize("Warming up."):
            pass
        for _ in range(args.repeats):
            for sentence in SENTENCES:
                start = time.perf_counter()
                samples = 0
                async for chunk in tts.synthesize(sentence):
                    samples += chunk.size
                took = time.perf_counter() - start
                seconds = samples / tts.sample_rate
                rtfs.append(took / seconds)
                synth_s.append(took)
                audio_s += seconds
    finally:
        await tts.aclose()
    return {
        "model": model_dir if args.model else "random VITS, the shape of tts_models/en/ljspeech/vits",
        "device": args.device, "sample_rate": tts.sample_rate, "torch_threads": _torch_threads(),
        "load_s": round(load_s, 2), "sentences": len(rtfs), "audio_s": round(audio_s, 2),
        "rtf": {"p50": round(pct(rtfs, 50) or 0, 3), "p95": round(pct(rtfs, 95) or 0, 3),
                "mean": round(sum(synth_s) / audio_s, 3)},
        "synthesis_ms": summarise(synth_s),
    }


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.model:
        return await measure(args, args.model)
    with tempfile.TemporaryDirectory() as tmp:
        from coqui_random import build  # same folder

        model_dir = await asyncio.to_thread(build, os.path.join(tmp, "vits"))
        return await measure(args, str(model_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=JSON_EPILOG)
    ap.add_argument("--model", help="a Coqui model directory (default: a random VITS of the real shape, built now)")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the sentences")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--max-wall-s", type=float, default=900.0)
    args = ap.parse_args()
    results = run_with_deadline(run(args), args.max_wall_s, "coqui_rtf")
    rtf = results["rtf"]
    print(f"coqui {results['model']} on {args.device}: {results['sentences']} sentences, "
          f"{results['audio_s']} s of audio; RTF p50 {rtf['p50']} p95 {rtf['p95']} (all: {rtf['mean']}); "
          f"synthesis p50 {results['synthesis_ms']['p50']} ms; load {results['load_s']} s")
    write_result(args.json, "coqui_rtf", args, results)


if __name__ == "__main__":
    main()
