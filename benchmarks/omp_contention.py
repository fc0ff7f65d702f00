"""The ASR final beside Smart Turn, under the OpenMP wait policy the process was started with.

The session's ASR final is a 2-thread CTranslate2 Whisper decode (libgomp); Smart Turn's
inference (onnxruntime, 1 thread) runs at the pause check beside it on the same 2 cores.
libgomp's idle threads spin (``GOMP_SPINCOUNT``, 300,000 turns by default) before they
sleep; a spinning thread holds a core another thread could use. This times, per clip of
/work/shared/audio, the decode alone, Smart Turn alone, and the decode with Smart Turn
submitted ``--offset-ms`` after it started. Run it once per environment, e.g.:

    flock /tmp/heavy.lock .venv/bin/python benchmarks/omp_contention.py --json OUT/default.json
    OMP_WAIT_POLICY=PASSIVE flock /tmp/heavy.lock .venv/bin/python benchmarks/omp_contention.py --json OUT/passive.json

The model and window are the CPU default's (whisper-base, utterance + 1 s, >= 8 s).
Prints medians / p95 and writes the raw figures as JSON. Timings only, nothing asserted.
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
ENV_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundle:whisper-base")
    ap.add_argument("--pad-s", type=float, default=1.0)
    ap.add_argument("--min-s", type=float, default=8.0)
    ap.add_argument("--offset-ms", type=float, default=100.0, help="submit Smart Turn this long after the decode starts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    models = ModelsConfig()
    whisper = WindowedWhisper(str(resolve_model(args.model, models)), device="cpu", compute_type="int8",
                              cpu_threads=2, num_workers=1)

    def decode(audio: np.ndarray) -> float:
        t0 = time.perf_counter()
        whisper.transcribe_text(audio, pad_s=args.pad_s, min_s=args.min_s, language="en", beam_size=1, best_of=1,
                                temperature=0.0, condition_on_previous_text=False, without_timestamps=True,
                                vad_filter=False, suppress_blank=True, prefix=None)
        return time.perf_counter() - t0

    st = SmartTurn(resolve_model("bundle:smart-turn-v3.2", models), threads=1)
    clips = [read_wav(p, ASR_RATE)[0] for p in sorted(AUDIO.glob("*.wav"))]
    decode(clips[0])
    st.submit(clips[0]).result()  # warm-up
    rows: dict[str, list[float]] = {"decode_alone": [], "smart_alone": [], "decode_beside": [], "smart_beside": []}
    for _ in range(args.rounds):
        for audio in clips:
            rows["decode_alone"].append(decode(audio))
            t0 = time.perf_counter()
            st.submit(audio).result()
            rows["smart_alone"].append(time.perf_counter() - t0)
            done: dict[str, float] = {}

            def run_decode(audio: np.ndarray = audio, done: dict[str, float] = done) -> None:
                done["decode"] = decode(audio)

            th = threading.Thread(target=run_decode)
            th.start()
            time.sleep(args.offset_ms / 1000)
            t1 = time.perf_counter()
            st.submit(audio).result()
            rows["smart_beside"].append(time.perf_counter() - t1)
            th.join()
            rows["decode_beside"].append(done["decode"])
    st.close()
    env = {k: os.environ.get(k) for k in ENV_KEYS}
    med = {k: round(1000 * statistics.median(v)) for k, v in rows.items()}
    med["decode_extra_paired"] = round(1000 * statistics.median(
        b - a for a, b in zip(rows["decode_alone"], rows["decode_beside"], strict=True)))
    p95 = {k: round(1000 * float(np.percentile(v, 95))) for k, v in rows.items()}
    print(f"env {env}\nmedian ms {med}\np95 ms    {p95}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"env": env, "args": vars(args) | {"json": str(args.json)},
                                         "median_ms": med, "p95_ms": p95, "raw_s": rows}, indent=1))


if __name__ == "__main__":
    main()
