"""TTS at scale: concurrent reply streams on our ``PiperTts`` over one machine's CPU cores.

    python benchmarks/gpu_tts.py --voice DIR --sessions 64 128 --workers 8 16 --json OUT

Drives the server's own engine (``voicebot.engines.tts_piper.PiperTts``: one ONNX
session, ``tts.workers`` synthesis threads, the bounded job queue) the way sessions use
it: each simulated session speaks a reply clause by clause (a short first clause, then
sentences), plays it out in real time, then listens for ``--listen-s`` before the next
reply. Per reply: first audio (the first clause's synthesis, queueing included) and
stalls, i.e. playback time lost waiting for the next clause (a stream is real-time if
it never stalls: RTF >= 1 from the listener's side).

``--intra-op``: onnxruntime threads per synthesis (0: Piper's default, all cores, shared
by every concurrent run of the one session). A value patches ``SessionOptions`` for the
run; it is a measurement of a possible change to voicebot/engines/tts/piper.py, not what it does today.

CPU only; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench_util import JSON_EPILOG, bare_engines_package, write_result  # same folder

bare_engines_package()

from llm_load import run_with_deadline  # noqa: E402
from tts_workload import FIRST_AUDIO, Stats, caller, scenario_table  # noqa: E402

from voicebot.config import TtsConfig  # noqa: E402

log = logging.getLogger("gpu_tts")

async def session(eng: Any, args: argparse.Namespace, st: Stats, t_start: float, t_end: float,
                  rng: random.Random) -> None:
    await caller(lambda clause, ahead: eng.synthesize(clause), eng.sample_rate, args, st, t_start, t_end, rng)


async def scenario(eng: Any, args: argparse.Namespace, n: int) -> dict[str, Any]:
    st = Stats()
    t_start = time.monotonic()
    t_end = t_start + args.duration_s
    base = random.Random(f"{args.seed}-{n}")
    cpu0 = os.times()
    tasks = [asyncio.create_task(session(eng, args, st, t_start, t_end, random.Random(base.random())))
             for _ in range(n)]
    _, late = await asyncio.wait(tasks, timeout=args.duration_s + 60)
    for t in late:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    cpu1 = os.times()
    wall = time.monotonic() - t_start
    return st.report(n, wall, cpu1.user - cpu0.user + cpu1.system - cpu0.system, args.stall_tolerance_s, len(late))


def patch_intra_op(threads: int) -> None:
    import onnxruntime

    original = onnxruntime.SessionOptions

    def options() -> Any:
        o = original()
        o.intra_op_num_threads = threads
        o.inter_op_num_threads = 1
        return o

    onnxruntime.SessionOptions = options  # type: ignore[misc]


def dump(args: argparse.Namespace, report: dict[str, Any]) -> None:
    write_result(args.json, "gpu_tts", args, report)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    from voicebot.engines.tts.piper import PiperTts

    report: dict[str, Any] = {"cpus": os.cpu_count(), "voice": str(args.voice), "argv": sys.argv, "scenarios": []}
    for intra in args.intra_op:
        if intra:
            patch_intra_op(intra)
        for workers in args.workers:
            eng = PiperTts(TtsConfig(engine="piper", voice=str(args.voice), workers=workers, queue_size=100_000),
                           str(args.voice))
            await eng.start()
            try:
                async for _ in eng.synthesize("Warming up the voice."):
                    pass
                for n in args.sessions:
                    res = await scenario(eng, args, n)
                    res.update(workers=workers, intra_op=intra)
                    report["scenarios"].append(res)
                    print(f"[gpu_tts] workers {workers} intra-op {intra} sessions {n}: first audio "
                          f"{res['first_audio_ms']} stalled {res['stalled_fraction']} audio/wall "
                          f"{res['audio_s_per_wall_s']} cpu {res['process_cpu']}", flush=True)
                    dump(args, report)
            finally:
                await eng.aclose()
    return report


def table(report: dict[str, Any]) -> str:
    return scenario_table(report["scenarios"], [
        ("workers", 8, "workers"), ("intra", 6, "intra_op"), ("sessions", 9, "sessions"),
        ("replies", 8, "replies_measured"), FIRST_AUDIO, ("stalled", 9, "stalled_fraction"),
        ("stall p95 ms", 13, lambda r: r["stall_ms"].get("p95")), ("audio s/s", 10, "audio_s_per_wall_s"),
        ("cpu", 6, "process_cpu"),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("--voice", type=Path, required=True, help="Piper voice directory (.onnx + .onnx.json)")
    p.add_argument("--sessions", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--workers", type=int, nargs="+", default=[8], help="tts.workers values to run")
    p.add_argument("--intra-op", type=int, nargs="+", default=[0], help="0: Piper's default ORT threads")
    p.add_argument("--sentences", type=int, default=2, help="sentences after the first clause")
    p.add_argument("--listen-s", type=float, nargs=2, default=[2.0, 4.0], help="caller speaks between replies")
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--stall-tolerance-s", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--max-wall-s", type=float, default=400.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    report = run_with_deadline(amain(args), args.max_wall_s, "gpu_tts")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
