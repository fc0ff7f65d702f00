"""Engine benchmark: each shared engine alone, on the configured hardware.

    python benchmarks/engines.py --config configs/default.yaml --json artifacts/bench-engines.json

ASR: final latency (finalize() right after the last chunk of speech) and real-time
factor over the test clips; LLM: time to first token with and without a cached
prefix, decode tokens/s at batch 1 and 8; TTS: time to first audio and real-time
factor. Prints a table and writes --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from bench_util import JSON_EPILOG, summarise_ms, write_result  # benchmarks/, beside this file

from voicebot.audio import ASR_RATE, read_wav
from voicebot.config import Config, load_config
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.contracts import GenerationStats, Lane
from voicebot.engines.llm.inprocess import LlmEngine
from voicebot.engines.registry import create_tts
from voicebot.provision import resolve_model

SHARED_AUDIO = Path(__file__).resolve().parents[1].parent / "shared" / "audio"
SYSTEM = (
    "You are a friendly voice assistant for a regional rail company. You answer questions about "
    "timetables, tickets, delays, accessibility, bicycles on trains, lost property and refunds. "
) * 6


def clips(folder: Path) -> list[tuple[str, np.ndarray]]:
    files = sorted(folder.glob("*.wav"))
    if not files:
        sys.exit(f"benchmarks/engines.py: no WAV files in {folder} (use --audio DIR)")
    return [(f.stem, read_wav(f, ASR_RATE)[0]) for f in files]


async def bench_asr(cfg: Config, audio: list[tuple[str, np.ndarray]], rounds: int) -> dict:
    """Feed each clip in real time (20 ms chunks, partials running as in a call), then
    ask for the final at the end of speech: once as a fresh decode, once the way the
    session does it (a decode requested when the caller goes quiet, reused as final)."""
    engine = AsrEngine(cfg.asr, resolve_model(cfg.asr.model, cfg.models), agreement_n=cfg.asr.agreement_n)
    await engine.start()
    fresh, reused, rtfs = [], [], []
    try:
        for _ in range(rounds):
            for _name, samples in audio:
                for mode in ("fresh", "reused"):
                    async with engine.stream(language=cfg.asr.language) as stream:
                        t_start = time.perf_counter()
                        for i in range(0, samples.size, 320):
                            stream.push(samples[i : i + 320])
                            due = t_start + (i + 320) / ASR_RATE
                            await asyncio.sleep(max(0.0, due - time.perf_counter()))
                        t0 = time.perf_counter()
                        if mode == "fresh":
                            result = await stream.finalize()
                            rtfs.append(result.decode_s / result.audio_s)
                            fresh.append(1000 * (time.perf_counter() - t0))
                        else:
                            stream.request_partial()
                            await stream.finalize(covering_s=samples.size / ASR_RATE)
                            reused.append(1000 * (time.perf_counter() - t0))
    finally:
        await engine.aclose()
    return {
        "final_latency_ms": summarise_ms(fresh),
        "final_latency_reusing_partial_ms": summarise_ms(reused),
        "rtf": {"p50": round(float(np.median(rtfs)), 3), "n": len(rtfs)},
    }


async def bench_llm(cfg: Config, rounds: int) -> dict:
    engine = LlmEngine(cfg.llm, resolve_model(cfg.llm.model, cfg.models))
    await engine.start()
    tok = engine.tokenizer

    def prompt(system: str, user: str) -> list[int]:
        return tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )

    cold, warm, cached = [], [], []
    try:
        for i in range(rounds):
            system = f"[{uuid.uuid4().hex}] {SYSTEM}"  # a prefix no earlier request shared
            for kind in ("cold", "warm"):
                st = GenerationStats("", Lane.INTERACTIVE)
                await engine.complete(prompt(system, f"Question {i} {kind}: when is the next train?"), max_tokens=1, stats=st)
                (cold if kind == "cold" else warm).append(1000 * (st.ttft_s or 0))
                if kind == "warm":
                    cached.append(st.cached_tokens / st.prompt_tokens)
        decode = {}
        for batch in (1, 8):
            ids = prompt(SYSTEM, "Tell me a long story about trains.")
            stats = [GenerationStats("", Lane.INTERACTIVE) for _ in range(batch)]
            t0 = time.perf_counter()
            await asyncio.gather(*(engine.complete(ids, max_tokens=64, min_tokens=64, stats=s) for s in stats))
            elapsed = time.perf_counter() - t0
            tokens = sum(s.output_tokens for s in stats)
            per_seq = [s.output_tokens / ((s.finished_at or 0) - (s.first_token_at or 0)) for s in stats]
            decode[f"batch_{batch}"] = {"tokens_per_s_total": round(tokens / elapsed, 1), "tokens_per_s_per_seq": round(statistics.median(per_seq), 1)}
    finally:
        await engine.aclose()
    return {
        "prompt_tokens": len(prompt(SYSTEM, "Question 0 cold: when is the next train?")),
        "ttft_cold_ms": summarise_ms(cold),
        "ttft_cached_prefix_ms": summarise_ms(warm),
        "cached_fraction_p50": round(float(np.median(cached)), 3),
        "decode": decode,
    }


async def bench_tts(cfg: Config, rounds: int) -> dict:
    out = {}
    texts = ["Sure, the next train leaves at ten past six.", "Hello there!", "I can help with that. Which station are you travelling from, and when would you like to leave?"]
    for engine_name in ("piper", "espeak"):
        tcfg = cfg.tts.model_copy(update={"engine": engine_name, "voice": cfg.tts.voice if engine_name == "piper" else "en-us"})
        voice = resolve_model(tcfg.voice, cfg.models) if engine_name == "piper" else None
        tts = create_tts(tcfg, voice)
        await tts.start()
        firsts, rtfs = [], []
        try:
            for _ in range(rounds):
                for text in texts:
                    t0 = time.perf_counter()
                    first = None
                    samples = 0
                    async for chunk in tts.synthesize(text):
                        first = first or time.perf_counter()
                        samples += chunk.size
                    total = time.perf_counter() - t0
                    firsts.append(1000 * ((first or t0) - t0))
                    rtfs.append(total / (samples / tts.sample_rate))
        finally:
            await tts.aclose()
        out[engine_name] = {"first_audio_ms": summarise_ms(firsts), "rtf": {"p50": round(float(np.median(rtfs)), 3), "n": len(rtfs)}}
    return out


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--audio", type=Path, default=SHARED_AUDIO, help="folder of 16 kHz WAV clips")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["asr", "llm", "tts"], action="append")
    parser.add_argument("--json", type=Path, default=Path("artifacts/bench-engines.json"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = load_config(args.config, args.overrides)
    parts = args.only or ["asr", "llm", "tts"]
    result: dict = {}
    # One engine at a time: each is measured alone, with the cores to itself.
    if "asr" in parts:
        result["asr"] = await bench_asr(cfg, clips(args.audio), args.rounds)
        print("ASR", json.dumps(result["asr"]))
    if "llm" in parts:
        result["llm"] = await bench_llm(cfg, max(args.rounds * 3, 5))
        print("LLM", json.dumps(result["llm"]))
    if "tts" in parts:
        result["tts"] = await bench_tts(cfg, args.rounds)
        print("TTS", json.dumps(result["tts"]))
    write_result(args.json, "engines", args, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
