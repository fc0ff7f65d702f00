"""GPU ASR load benchmark: concurrent real-time streams on our ``VllmAsrEngine`` (Whisper on vLLM).

    python benchmarks/gpu_asr.py --model-dir DIR --clips DIR --streams 64 256 --json OUT

What it drives is the server's own code: ``voicebot.engines.asr_vllm.VllmAsrEngine``
(the same ``AsrStream`` a session uses: partials every ``--partial-ms``, LocalAgreement,
the finals-first queue) over a Whisper of the real shape with ``load_format="dummy"``.
Random weights decode random tokens, so each decode is made to produce the token count
a real transcript of that audio would have (``--tokens-per-s`` of audio; forced with
min_tokens = max_tokens): compute per decode is then that of real use.

Each simulated caller, in real time: speaks an utterance (a slice of a test clip,
``--utterance-s`` long) in ``--chunk-ms`` chunks; at the end of speech asks for a
partial (the session's QUIET signal), after ``--pause-ms`` asks for the final the way
the session does (``finalize(covering_s=...)``: the partial that saw the end of speech
is reused), then is silent for ``--gap-s`` (the bot's reply) and speaks again.

Measured per final: time from the end of speech to the transcript (the figure the
target "final p95 <= 300 ms after end of speech" is about) and from the finalize() call.
Per partial: lag behind the audio it covers. Also decodes/s, dropped partials, event-loop
lag and a burst test (``--burst``: that many one-shot 5 s decodes at once: throughput).

Needs a CUDA GPU with vLLM; stops by itself (``--max-wall-s``). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np
from bench_util import JSON_EPILOG, bare_engines_package, write_result  # same folder

# voicebot/engines/__init__.py imports every engine (faster-whisper, piper, onnx VAD ...),
# which a GPU machine running only this benchmark lacks: load the package's modules
# without it.
bare_engines_package()

from llm_load import device_name, pct, run_with_deadline, summarise  # noqa: E402  (same folder)

from voicebot.audio import ASR_RATE  # noqa: E402
from voicebot.config import AsrConfig  # noqa: E402
from voicebot.engines.asr.jobs import DecodeJob  # noqa: E402
from voicebot.engines.asr.vllm_whisper import VllmAsrEngine, WhisperVllmSettings  # noqa: E402

log = logging.getLogger("gpu_asr")


class FixedLengthEngine(VllmAsrEngine):
    """Random weights never stop on their own: decode as many tokens as real speech has."""

    tokens_per_s: float = 4.0

    def token_budget(self, job: DecodeJob, prompt_len: int) -> tuple[int, int]:
        assert job.audio is not None
        _, cap = super().token_budget(job, prompt_len)
        total = max(2, round(job.audio.size / ASR_RATE * self.tokens_per_s))
        forced = prompt_len - 4  # prompt = 4 task tokens + the confirmed prefix
        n = max(1, min(cap, total - forced))
        return n, n


def load_clips(folder: Path) -> list[np.ndarray]:
    clips = []
    for path in sorted(folder.glob("*.wav")):
        with wave.open(str(path)) as w:
            if w.getframerate() != ASR_RATE or w.getnchannels() != 1 or w.getsampwidth() != 2:
                continue
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
        clips.append(pcm.astype(np.float32) / 32768.0)
    if not clips:
        raise SystemExit(f"no 16 kHz mono PCM16 .wav clips in {folder}")
    return clips


class Scenario:
    def __init__(self) -> None:
        self.finals_eos: list[float] = []  # end of speech -> transcript
        self.finals_call: list[float] = []  # finalize() -> transcript
        self.final_audio_s: list[float] = []
        self.reused = 0  # finals that were the partial which saw the end of speech
        self.partial_lag: list[float] = []  # partial emitted - (utterance start + audio it saw)
        self.partials = 0
        self.utterances = 0
        self.errors: list[str] = []


async def caller(
    eng: VllmAsrEngine, clips: list[np.ndarray], args: argparse.Namespace, sc: Scenario,
    t_start: float, t_end: float, rng: random.Random,
) -> None:
    stream = eng.stream()
    chunk = int(args.chunk_ms * ASR_RATE / 1000)
    utt_start = 0.0

    async def read_partials() -> None:
        async for p in stream:
            sc.partials += 1
            if time.monotonic() - t_start >= args.warmup_s:
                sc.partial_lag.append(time.monotonic() - (utt_start + p.audio_s))

    reader = asyncio.create_task(read_partials())
    try:
        await asyncio.sleep(rng.uniform(0, args.gap_s[1]))  # callers start spread out
        while time.monotonic() < t_end:
            clip = clips[rng.randrange(len(clips))]
            length = min(clip.size, int(rng.uniform(*args.utterance_s) * ASR_RATE))
            start = rng.randrange(0, clip.size - length + 1)
            audio = clip[start:start + length]
            stream.reset()
            utt_start = time.monotonic()
            for k, i in enumerate(range(0, audio.size, chunk)):
                # Absolute schedule: a late wake-up does not slow the caller's speech down.
                delay = utt_start + (k + 1) * args.chunk_ms / 1000 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                stream.push(audio[i:i + chunk])
            eos = time.monotonic()
            stream.request_partial()  # QUIET: the first silent VAD window
            await asyncio.sleep(args.pause_ms / 1000)  # PAUSE: the speculative final
            t_call = time.monotonic()
            try:
                tr = await asyncio.wait_for(stream.finalize(covering_s=stream.buffered_s), args.final_timeout_s)
            except Exception as exc:  # noqa: BLE001 - record and go on
                sc.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            done = time.monotonic()
            if eos - t_start >= args.warmup_s:
                sc.finals_eos.append(done - eos)
                sc.finals_call.append(done - t_call)
                sc.final_audio_s.append(tr.audio_s)
                sc.reused += tr.decode_s == 0.0
            sc.utterances += 1
            gap = rng.uniform(*args.gap_s)
            if time.monotonic() + gap >= t_end:
                break
            await asyncio.sleep(gap)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await stream.aclose()


async def run_scenario(eng: VllmAsrEngine, clips: list[np.ndarray], args: argparse.Namespace, n: int) -> dict[str, Any]:
    sc = Scenario()
    s0 = (eng.stats.partial_decodes, eng.stats.final_decodes, eng.stats.dropped_partials, eng.stats.failed_decodes)
    t_start = time.monotonic()
    t_end = t_start + args.duration_s
    base = random.Random(f"{args.seed}-{n}")
    peak = {"in_flight": 0, "queue": 0}
    lags: list[float] = []

    async def sample() -> None:
        while True:
            peak["in_flight"] = max(peak["in_flight"], eng.in_flight)
            peak["queue"] = max(peak["queue"], eng.queue_depth)
            await asyncio.sleep(0.05)

    async def lag_probe() -> None:
        while True:
            a = time.monotonic()
            await asyncio.sleep(0.005)
            lags.append(time.monotonic() - a - 0.005)

    helpers = [asyncio.create_task(sample()), asyncio.create_task(lag_probe())]
    cpu0 = os.times()
    tasks = [asyncio.create_task(caller(eng, clips, args, sc, t_start, t_end, random.Random(base.random())))
             for _ in range(n)]
    _, late = await asyncio.wait(tasks, timeout=args.duration_s + args.final_timeout_s + 5)
    for t in late:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for h in helpers:
        h.cancel()
    await asyncio.gather(*helpers, return_exceptions=True)
    cpu1 = os.times()
    wall = time.monotonic() - t_start
    st = eng.stats
    partial_d, final_d = st.partial_decodes - s0[0], st.final_decodes - s0[1]
    eos = sc.finals_eos
    return {
        "streams": n,
        "duration_s": args.duration_s,
        "wall_s": round(wall, 1),
        "utterances": sc.utterances,
        "finals_measured": len(eos),
        "final_after_eos_ms": summarise(eos),
        "final_after_call_ms": summarise(sc.finals_call),
        "final_within_300ms": round(sum(1 for x in eos if x <= 0.3) / len(eos), 4) if eos else None,
        "final_reused_partial": sc.reused,
        "final_audio_s_mean": round(sum(sc.final_audio_s) / len(sc.final_audio_s), 2) if sc.final_audio_s else None,
        "partial_lag_ms": summarise(sc.partial_lag),
        "partials_emitted": sc.partials,
        "decodes_per_s": round((partial_d + final_d) / wall, 1),
        "partial_decodes": partial_d,
        "final_decodes": final_d,
        "dropped_partials": st.dropped_partials - s0[2],
        "failed_decodes": st.failed_decodes - s0[3],
        "errors": sc.errors[:10],
        "n_errors": len(sc.errors),
        "callers_cut": len(late),
        "peak": peak,
        "loop_lag_ms": summarise(lags),
        "api_process_cpu": round((cpu1.user - cpu0.user + cpu1.system - cpu0.system) / wall, 2),
        "meets_target": bool(eos) and (pct([x * 1000 for x in eos], 95) or 1e9) <= 300 and not sc.errors,
    }


async def burst(eng: VllmAsrEngine, clips: list[np.ndarray], n: int, seconds: float) -> dict[str, Any]:
    """n one-shot decodes of ``seconds`` of audio submitted at once: encoder+decoder throughput."""
    clip = max(clips, key=lambda c: c.size)
    audio = clip[: int(seconds * ASR_RATE)]
    t0 = time.monotonic()
    done: list[float] = []

    async def one() -> None:
        await eng.transcribe(audio)
        done.append(time.monotonic() - t0)

    await asyncio.gather(*[one() for _ in range(n)])
    wall = time.monotonic() - t0
    return {"decodes": n, "audio_s": seconds, "wall_s": round(wall, 2), "decodes_per_s": round(n / wall, 1),
            "latency_ms": summarise(done)}


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    clips = load_clips(args.clips)
    settings = WhisperVllmSettings(
        concurrency=args.concurrency,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        load_format=args.load_format,
        dtype=args.dtype,
        feature_workers=args.feature_workers,
        enforce_eager=args.enforce_eager,
        window_pad_s=args.window_pad_s,
        window_min_s=args.window_min_s,
    )
    cfg = AsrConfig(backend="vllm", partial_interval_ms=args.partial_ms, queue_size=args.queue_size,
                    agreement_n=3, language="en")
    FixedLengthEngine.tokens_per_s = args.tokens_per_s
    eng = FixedLengthEngine(cfg, str(args.model_dir), agreement_n=3, settings=settings)
    report: dict[str, Any] = {
        "device": device_name(),
        "model_dir": str(args.model_dir),
        "model_config": json.loads((args.model_dir / "config.json").read_text()),
        "weights": args.load_format,
        "settings": settings.__dict__,
        "asr_config": cfg.model_dump(),
        "argv": sys.argv,
        "scenarios": [],
    }

    def dump() -> None:
        if args.json:
            write_result(args.json, "gpu_asr", args, report)

    t0 = time.monotonic()
    await eng.start()
    report["engine_start_s"] = round(time.monotonic() - t0, 1)
    print(f"[gpu_asr] engine up in {report['engine_start_s']} s on {report['device']}", flush=True)
    try:
        await burst(eng, clips, 32, 5.0)  # warm-up (graph shapes, allocator), not measured
        if args.burst:
            report["burst"] = await burst(eng, clips, args.burst, 5.0)
            print(f"[gpu_asr] burst: {report['burst']}", flush=True)
            dump()
        for interval in args.partial_ms_sweep or [args.partial_ms]:
            eng.cfg.partial_interval_ms = interval
            for n in args.streams:
                res = await run_scenario(eng, clips, args, n)
                res["partial_interval_ms"] = interval
                report["scenarios"].append(res)
                dump()
                print(f"[gpu_asr] {n} streams, partials every {interval} ms: final after EOS "
                      f"{res['final_after_eos_ms']} decodes/s {res['decodes_per_s']} dropped "
                      f"{res['dropped_partials']} errors {res['n_errors']} loop lag p99 "
                      f"{res['loop_lag_ms'].get('p99')}", flush=True)
    finally:
        await eng.aclose()
    dump()
    return report


def table(report: dict[str, Any]) -> str:
    head = (f"{'streams':>8}{'partial ms':>11}{'finals':>8}{'final after EOS p50/p95/p99 ms':>32}"
            f"{'from call p95':>14}{'decodes/s':>10}{'dropped':>8}{'loop p99':>9}{'ok':>4}")
    lines = [head, "-" * len(head)]
    for r in report["scenarios"]:
        f = r["final_after_eos_ms"]
        final = f"{f.get('p50')}/{f.get('p95')}/{f.get('p99')}"
        lines.append(f"{r['streams']:>8}{r['partial_interval_ms']:>11}{r['finals_measured']:>8}{final:>32}"
                     f"{r['final_after_call_ms'].get('p95')!s:>14}{r['decodes_per_s']:>10}{r['dropped_partials']:>8}"
                     f"{r['loop_lag_ms'].get('p99')!s:>9}{'yes' if r['meets_target'] else 'no':>4}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("--model-dir", type=Path, required=True, help="Whisper HF directory (gpu_whisper_files.py)")
    p.add_argument("--clips", type=Path, required=True, help="folder of 16 kHz mono PCM16 .wav speech clips")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=3.0, help="finals before this are not counted")
    p.add_argument("--partial-ms", type=int, default=1000, help="asr.partial_interval_ms")
    p.add_argument("--partial-ms-sweep", type=int, nargs="*", default=[], help="run every --streams at each")
    p.add_argument("--chunk-ms", type=int, default=60, help="audio pushed per wake-up")
    p.add_argument("--utterance-s", type=float, nargs=2, default=[1.5, 6.0])
    p.add_argument("--gap-s", type=float, nargs=2, default=[1.5, 4.0], help="silence between utterances")
    p.add_argument("--pause-ms", type=int, default=160, help="end of speech -> finalize() (vad.speculative_silence_ms)")
    p.add_argument("--tokens-per-s", type=float, default=4.0, help="transcript tokens per second of speech")
    p.add_argument("--final-timeout-s", type=float, default=15.0)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=12_000)
    p.add_argument("--feature-workers", type=int, default=4)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--window-pad-s", type=float, default=None,
                   help="asr.encoder_pad_s: encode the utterance + this (rounded up to 8/10/12/15/20/30 s) "
                        "instead of 30 s (voicebot/engines/asr/whisper_vllm_window.py); unset: 30 s")
    p.add_argument("--window-min-s", type=float, default=8.0, help="asr.encoder_min_s (with --window-pad-s)")
    p.add_argument("--queue-size", type=int, default=4096)
    p.add_argument("--burst", type=int, default=256, help="one-shot decodes at once for the throughput test (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--max-wall-s", type=float, default=560.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    report = run_with_deadline(amain(args), args.max_wall_s, "gpu_asr")
    print(f"\ndevice: {report['device']}  engine start: {report['engine_start_s']} s  weights: {report['weights']}")
    if "burst" in report:
        print(f"burst: {report['burst']}")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
