"""What the checks that run inline on the event loop cost: Silero VAD per 32 ms window, and
the JSON depth guard on a large client message.

Both run on the loop thread for every caller (VAD on every inbound frame, ``load_json``
on every client event), so their cost is a share of the loop per caller. The unit tests
check what they compute; how long they take is measured here, not asserted there:

    python benchmarks/inline_cost.py --audio ../shared/audio --rounds 20 \
        --json artifacts/inline_cost.json

Output: per check, p50/p95/p99/max in ms over the rounds (VAD: per window, one window per
call, the worst case; JSON: per message), and the same as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_util import pct  # noqa: E402
from voicebot.audio import ASR_RATE  # noqa: E402
from voicebot.engines.vad import WINDOW, SileroVad, default_model_path  # noqa: E402
from voicebot.server import edge  # noqa: E402

SHARED_AUDIO = ROOT.parent / "shared" / "audio"


def summarise(values_s: list[float]) -> dict:
    """Milliseconds to the microsecond (a VAD window costs a fraction of one)."""
    ms = [x * 1000.0 for x in values_s]
    return {"n": len(ms), **{f"p{p}": round(pct(ms, p) or 0.0, 3) for p in (50, 95, 99)}, "max": round(max(ms), 3)}


def bench_vad(audio: np.ndarray, rounds: int) -> dict:
    """Per-window cost, one 512-sample window per call (a session feeds 20 ms frames, so
    most calls carry at most one window)."""
    vad = SileroVad(default_model_path())
    stream = vad.stream()
    stream.process(audio[:WINDOW])  # warm-up: the first call builds the session state
    per_window: list[float] = []
    for _ in range(rounds):
        stream.reset()
        for i in range(0, audio.size - WINDOW + 1, WINDOW):
            t0 = time.perf_counter()
            stream.process(audio[i : i + WINDOW])
            per_window.append(time.perf_counter() - t0)
    return {"what": "silero vad, one 32 ms window per call", **summarise(per_window)}


def bench_json(rounds: int) -> dict:
    """The depth guard's exact scan runs only on a message with more brackets than the
    limit: the worst legal case is a large, shallow, bracket-heavy one."""
    wide = json.dumps({"type": "x", "items": [[] for _ in range(300_000)]})
    deep = "[" * 1_000_000
    scan, parse, refuse = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        edge.json_depth(wide)
        scan.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        edge.load_json(wide)
        parse.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with contextlib.suppress(edge.BadMessage):
            edge.load_json(deep)
        refuse.append(time.perf_counter() - t0)
    return {
        "scan": {"what": "json_depth alone, the same message", **summarise(scan)},
        "wide": {"what": f"load_json, {len(wide) / 2**20:.2f} MiB, 300k empty arrays", **summarise(parse)},
        "deep": {"what": "load_json refusing 1M nested '['", **summarise(refuse)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--audio", type=Path, default=SHARED_AUDIO, help="folder of 16 kHz WAV clips")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("artifacts/inline_cost.json"))
    args = parser.parse_args()

    clips = sorted(args.audio.glob("librivox_*.wav"))
    if not clips:
        parser.error(f"no librivox_*.wav in {args.audio}")
    audio, rate = sf.read(clips[0], dtype="float32")
    if rate != ASR_RATE:
        parser.error(f"{clips[0]} is {rate} Hz; the VAD takes {ASR_RATE}")
    result = {"vad": bench_vad(audio, args.rounds), **bench_json(args.rounds)}
    for name, row in result.items():
        print(f"{name:5s} p50 {row['p50']:8.3f} ms  p95 {row['p95']:8.3f}  p99 {row['p99']:8.3f}  "
              f"max {row['max']:8.3f}  (n={row['n']}; {row['what']})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
