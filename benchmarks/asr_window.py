"""Whisper's encoder window on short utterances: time split and word error rate.

    .venv/bin/python benchmarks/asr_window.py --json artifacts/asr_window.json [--pads 0.5,1,2]
        [--model bundle:whisper-base] [--streamed]

faster-whisper pads every window's features to 30 s (3000 frames), so tiny.en's encoder
costs the same for a 1 s question as for 30 s of speech. CTranslate2 accepts fewer frames
(since 3.19, "Relax shape checks for Whisper input features"): the encoder then runs on the
utterance plus ``pad`` seconds of zero features (``voicebot.engines.whisper_window``).

For each clip (every WAV with a ``.txt`` reference in ../shared/audio, and the Piper
questions of benchmarks/echo_rate.py in artifacts/echo/clips when they exist) and each
window (full 30 s, then utterance + pad), one decode as the session's final does it
(greedy, no timestamps, no previous text, from audio only) is timed: feature extraction +
encoder, and the rest (the decoder). Prints p50 / p95 over the clips, the WER of each
window on each set and the clips decoded into a loop, and writes JSON. ``--model`` (a
directory or ``bundle:NAME``) replaces ``asr.model``; the config's ``asr.language`` is
passed either way, so a multilingual model runs no language detection.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_util import JSON_EPILOG, pct, summarise_ms, write_result  # benchmarks/, beside this file

from voicebot.audio import ASR_RATE, read_wav
from voicebot.config import load_config
from voicebot.engines.asr.whisper_window import WindowedWhisper
from voicebot.provision import resolve_model

ROOT = Path(__file__).resolve().parents[1]
SHARED_AUDIO = ROOT.parent / "shared" / "audio"
QUESTIONS = ROOT / "artifacts" / "echo" / "clips"


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def looped(ref: list[str], hyp: list[str]) -> bool:
    """A hypothesis that repeats itself until the token limit: more than twice the
    reference and 4 words longer (a short question decoded as "Yes. Yes. Yes. ...")."""
    return len(hyp) > 2 * len(ref) + 4


def with_model(cfg: Any, model: str | None) -> Any:
    """``cfg`` with ``asr.model`` replaced by ``model`` (a directory or bundle:NAME), if given."""
    if not model:
        return cfg
    return cfg.model_copy(update={"asr": cfg.asr.model_copy(update={"model": model})})


def label(window: tuple[float, float] | None) -> str:
    if window is None:
        return "30 s"
    pad, least = window
    return f"audio+{pad:g} s" + (f", >= {least:g} s" if least else "")


def load_set() -> dict[str, list[tuple[str, np.ndarray, str]]]:
    sets: dict[str, list[tuple[str, np.ndarray, str]]] = {"recorded": [], "piper": []}
    for wav in sorted(SHARED_AUDIO.glob("*.wav")):
        ref = wav.with_suffix(".txt")
        if ref.exists():
            sets["recorded"].append((wav.stem, read_wav(wav, ASR_RATE)[0], ref.read_text().strip()))
    if QUESTIONS.is_dir():
        from echo_rate import QUESTIONS as TEXTS  # benchmarks/ is this script's sys.path[0]

        for wav in sorted(QUESTIONS.glob("q*.wav")):
            index = int(wav.stem[1:3])
            sets["piper"].append((wav.stem, read_wav(wav, ASR_RATE)[0], TEXTS[index]))
    return sets


async def streamed_final(engine: Any, audio: np.ndarray, interval_s: float) -> tuple[str, float]:
    """The final's text and decode seconds, partials asked every ``interval_s`` of audio."""
    per_partial, fed = round(interval_s * ASR_RATE), 0
    async with engine.stream() as stream:
        for start in range(0, audio.size, 320):
            stream.push(audio[start : start + 320])
            fed += min(320, audio.size - start)
            if fed >= per_partial:
                fed = 0
                await asyncio.wait_for(anext(stream), 60)
        final = await asyncio.wait_for(stream.finalize(), 60)
        return str(final.text), float(final.decode_s)


async def run_streamed(cfg: Any, windows: list[tuple[float, float] | None], sets: dict[str, Any]) -> list[dict[str, Any]]:
    from voicebot.engines.asr.engine import AsrEngine

    rows = []
    for window in windows:
        asr = cfg.asr.model_copy(update={"encoder_pad_s": None if window is None else window[0],
                                         "encoder_min_s": 0.0 if window is None else window[1]})
        async with AsrEngine(asr, resolve_model(asr.model, cfg.models), agreement_n=asr.agreement_n) as engine:
            for name, clips in sets.items():
                for stem, audio, ref in clips:
                    text, decode_s = await streamed_final(engine, audio, asr.partial_interval_ms / 1000)
                    ref_words, hyp = words(ref), words(text)
                    rows.append({"set": name, "clip": stem, "window": label(window), "text": text.strip(),
                                 "final_ms": round(1000 * decode_s, 1), "errors": edit_distance(ref_words, hyp),
                                 "ref_words": len(ref_words), "looped": looped(ref_words, hyp)})
    print(f"\nstreamed finals, {cfg.asr.model}\nset       window              n  final p50 / p95   WER        loops")
    for name in [*sets, "all"]:
        for window in windows:
            sel = [r for r in rows if name in ("all", r["set"]) and r["window"] == label(window)]
            if not sel:
                continue
            errors, n = sum(r["errors"] for r in sel), sum(r["ref_words"] for r in sel)
            finals = [r["final_ms"] for r in sel]
            print(f"{name:9} {label(window):18} {len(sel):3} {pct(finals, 50):8.0f} / {pct(finals, 95):4.0f}"
                  f"  {100 * errors / n:5.1f}% ({errors}/{n}) {sum(r['looped'] for r in sel)}")
    return rows


class TimedModel:
    """A :class:`WindowedWhisper` whose encoder calls are timed."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.model = WindowedWhisper(
            resolve_model(cfg.asr.model, cfg.models),
            device=cfg.asr.device,
            compute_type=cfg.asr.compute_type,
            cpu_threads=cfg.asr.cpu_threads,
        )
        self.encode_s: list[float] = []
        encode = self.model.encode

        def timed_encode(features: Any) -> Any:
            t0 = time.perf_counter()
            out = encode(features)
            self.encode_s.append(time.perf_counter() - t0)
            return out

        self.model.encode = timed_encode  # type: ignore[method-assign]

    def decode(self, audio: np.ndarray, window: tuple[float, float] | None) -> tuple[str, float, float]:
        """One final-style decode: the text, total ms and encoder ms."""
        self.encode_s.clear()
        t0 = time.perf_counter()
        text = self.model.transcribe_text(
            audio,
            pad_s=None if window is None else window[0],
            min_s=0.0 if window is None else window[1],
            language=self.cfg.asr.language,
            beam_size=self.cfg.asr.beam_size,
            best_of=1,
            temperature=0.0,
            condition_on_previous_text=False,
            without_timestamps=True,
            vad_filter=False,
            suppress_blank=True,
        )
        return text, 1000 * (time.perf_counter() - t0), 1000 * sum(self.encode_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--model", action="append", help="Whisper model instead of asr.model: a CTranslate2 directory "
                        "or bundle:NAME; repeat it to compare models clip by clip in one run (interleaved, so "
                        "load from outside falls on all of them)")
    parser.add_argument("--pads", default="0.5,1,2", help="seconds of padding after the utterance, comma-separated; PAD/MIN: "
                        "also at least MIN seconds in all")
    parser.add_argument("--no-full", action="store_true", help="leave out the full 30 s window")
    parser.add_argument("--streamed", action="store_true", help="the session's streamed finals (WER only)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("artifacts/asr_window.json"))
    args = parser.parse_args()

    base_cfg = load_config(args.config)
    cfgs = [with_model(base_cfg, model) for model in args.model or [None]]
    for cfg in cfgs:
        print(f"model {cfg.asr.model}, language {cfg.asr.language}, {cfg.asr.compute_type}, "
              f"{cfg.asr.cpu_threads} threads", flush=True)
    windows: list[tuple[float, float] | None] = [] if args.no_full else [None]
    for spec in filter(None, args.pads.split(",")):
        pad, _, least = spec.partition("/")
        windows.append((float(pad), float(least or 0)))
    sets = load_set()
    if args.streamed:
        streamed = [{"model": cfg.asr.model, **row} for cfg in cfgs for row in asyncio.run(run_streamed(cfg, windows, sets))]
        write_result(args.json, "asr_window", args, {"streamed": streamed})
        return 0
    models = [TimedModel(cfg) for cfg in cfgs]

    rows: list[dict[str, Any]] = []
    for name, clips in sets.items():
        for stem, audio, ref in clips:
            for timed in models:
                for pad in windows:
                    totals, encodes, text = [], [], ""
                    for _ in range(args.rounds):
                        text, total_ms, encode_ms = timed.decode(audio, pad)
                        totals.append(total_ms)
                        encodes.append(encode_ms)
                    ref_words, hyp = words(ref), words(text)
                    rows.append({
                        "model": timed.cfg.asr.model, "set": name, "clip": stem, "audio_s": round(audio.size / ASR_RATE, 2),
                        "window": label(pad), "total_ms": round(min(totals), 1), "encode_ms": round(min(encodes), 1),
                        "errors": edit_distance(ref_words, hyp), "ref_words": len(ref_words), "text": text.strip(),
                        "looped": looped(ref_words, hyp),
                    })
                    print(f"{name:8} {stem[:24]:24} {timed.cfg.asr.model.removeprefix('bundle:')[:14]:14} {label(pad):18}"
                          f" total {min(totals):6.0f} ms  encode {min(encodes):6.0f} ms"
                          f"  err {rows[-1]['errors']}/{len(ref_words)}  {text.strip()[:50]}", flush=True)

    summary: list[dict[str, Any]] = []
    for cfg in cfgs:
        print(f"\n{cfg.asr.model}\nset       window              n  total p50 / p95  encode p50 / p95  "
              "decoder p50 / p95   WER        loops")
        for name in [*sets, "all"]:
            for pad in windows:
                sel = [r for r in rows if r["model"] == cfg.asr.model and name in ("all", r["set"])
                       and r["window"] == label(pad)]
                if not sel:
                    continue
                total = [r["total_ms"] for r in sel]
                enc = [r["encode_ms"] for r in sel]
                dec = [r["total_ms"] - r["encode_ms"] for r in sel]
                errors, n = sum(r["errors"] for r in sel), sum(r["ref_words"] for r in sel)
                loops = sum(r["looped"] for r in sel)
                summary.append({"model": cfg.asr.model, "set": name, "window": label(pad), "n": len(sel),
                                "total_ms": summarise_ms(total), "encode_ms": summarise_ms(enc),
                                "decoder_ms": summarise_ms(dec),
                                "errors": errors, "ref_words": n, "wer": round(errors / n, 4), "looped": loops})
                print(f"{name:9} {label(pad):18} {len(sel):3} {pct(total, 50):8.0f} / {pct(total, 95):4.0f}"
                      f" {pct(enc, 50):9.0f} / {pct(enc, 95):4.0f} {pct(dec, 50):10.0f} / {pct(dec, 95):4.0f}"
                      f"  {100 * errors / n:5.1f}% ({errors}/{n}) {loops}")
    write_result(args.json, "asr_window", args, {"summary": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
