"""Smart Turn's inference beside a Whisper decode, at several thread priorities.

The session asks Smart Turn at a pause, while the speculative ASR final (a 2-thread
Whisper decode, the reply's critical path) runs on the same 2 cores. This measures,
per clip of /work/shared/audio and per variant of the Smart Turn thread (a nice
increment, SCHED_IDLE, or 2 onnxruntime threads):
  - the decode alone, and Smart Turn alone;
  - the decode with Smart Turn submitted ``--offset-ms`` after it started: the decode's
    time and Smart Turn's latency (submit to verdict).

    flock /tmp/heavy.lock .venv/bin/python benchmarks/smart_turn_contention.py --nice 0,10,19,idle,t2 --json OUT.json

Prints medians and writes the raw figures as JSON. Timings only, nothing asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from voicebot.audio import ASR_RATE, read_wav
from voicebot.config import ModelsConfig
from voicebot.engines.asr.whisper_window import WindowedWhisper
from voicebot.engines.turn.smart_turn import SmartTurn
from voicebot.provision import resolve_model

AUDIO = Path(os.environ.get("VOICEBOT_AUDIO", "/work/shared/audio"))


def decode(model: WindowedWhisper, audio: np.ndarray) -> float:
    t0 = time.perf_counter()
    model.transcribe_text(audio, pad_s=None, min_s=8.0, language="en", beam_size=1, best_of=1, temperature=0.0,
                          condition_on_previous_text=False, without_timestamps=True, vad_filter=False,
                          suppress_blank=True, prefix=None)
    return time.perf_counter() - t0


def set_priority(nice: str) -> None:
    """On the calling thread (Linux: a thread's own priority): a nice increment, or
    SCHED_IDLE ("idle"), under which any normal thread that wakes preempts it at once."""
    tid = threading.get_native_id()
    if nice == "idle":
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    elif int(nice) > 0:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + int(nice)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nice", default="0,10,19,idle", help="nice increments of the Smart Turn thread to compare, or idle (SCHED_IDLE), or t2 (2 onnxruntime threads)")
    ap.add_argument("--offset-ms", type=float, default=100.0, help="submit Smart Turn this long after the decode starts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    models = ModelsConfig()
    whisper = WindowedWhisper(str(resolve_model("bundle:whisper-tiny.en", models)), device="cpu", compute_type="int8",
                              cpu_threads=2, num_workers=1)
    st_path = resolve_model("bundle:smart-turn-v3.2", models)
    clips = [read_wav(p, ASR_RATE)[0] for p in sorted(AUDIO.glob("*.wav"))]
    decode(whisper, clips[0])  # warm-up
    result: list[dict[str, object]] = []  # one entry per variant, in the order run (a variant may repeat)
    for nice in args.nice.split(","):
        threads = 2 if nice == "t2" else 1  # t2: 2 onnxruntime threads, normal priority
        st = SmartTurn(st_path, threads=threads)
        if threads == 1:
            st._executor.submit(set_priority, nice).result()  # its one worker thread, from now on
        st.submit(clips[0]).result()  # warm-up, and the worker thread now has its priority
        rows: dict[str, list[float]] = {"decode_alone": [], "smart_alone": [], "decode_beside": [], "smart_beside": []}
        for _ in range(args.rounds):
            for audio in clips:
                rows["decode_alone"].append(decode(whisper, audio))
                t0 = time.perf_counter()
                st.submit(audio).result()
                rows["smart_alone"].append(time.perf_counter() - t0)
                done: dict[str, float] = {}

                def run_decode(audio: np.ndarray = audio, done: dict[str, float] = done) -> None:
                    done["decode"] = decode(whisper, audio)

                th = threading.Thread(target=run_decode)
                th.start()
                time.sleep(args.offset_ms / 1000)
                t1 = time.perf_counter()
                st.submit(audio).result()
                rows["smart_beside"].append(time.perf_counter() - t1)
                th.join()
                rows["decode_beside"].append(done["decode"])
        st.close()
        result.append({"variant": nice, **rows})
        med = {k: round(1000 * statistics.median(v)) for k, v in rows.items()}
        med["decode_extra_paired"] = round(1000 * statistics.median(b - a for a, b in zip(rows["decode_alone"], rows["decode_beside"], strict=True)))
        p95 = {k: round(1000 * float(np.percentile(v, 95))) for k, v in rows.items()}
        print(f"{nice}: median ms {med}  p95 ms {p95}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"offset_ms": args.offset_ms, "rounds": args.rounds, "results": result}, indent=1))


if __name__ == "__main__":
    main()
