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

from benchmarks.bench_util import summarise  # noqa: E402
from voicebot.audio import ASR_RATE  # noqa: E402
from voicebot.engines.turn.vad import WINDOW, SileroVad, default_model_path  # noqa: E402
from voicebot.server import edge  # noqa: E402

SHARED_AUDIO = ROOT.parent / "shared" / "audio"

# Milliseconds to the microsecond: a VAD window costs a fraction of one.
DIGITS = 3


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
    return {"what": "silero vad, one 32 ms window per call", **summarise(per_window, DIGITS)}


def bench_json(rounds: int) -> dict:
    """The worst legal-sized messages: large, bracket-heavy, refused by the container cap
    (``MAX_JSON_CONTAINERS``) from a count; what parsing one would cost without the cap; a
    bracket-heavy one under the cap, which gets the exact depth scan and the parse."""
    wide = json.dumps({"type": "x", "items": [[] for _ in range(300_000)]})
    under = json.dumps({"type": "x", "items": [[] for _ in range(edge.MAX_JSON_CONTAINERS - 2)]})
    deep = "[" * 1_000_000
    cases = {
        "wide": (f"load_json refusing {len(wide) / 2**20:.2f} MiB of 300k empty arrays", lambda: edge.load_json(wide)),
        "wide_uncapped": ("the same parsed (no container cap): depth scan + json.loads",
                          lambda: edge.load_json(wide, max_containers=10**9)),
        "scan": ("json_shape (the bracket scan) alone on it", lambda: edge.json_shape(wide)),
        "under_cap": (f"load_json parsing {len(under) / 2**10:.0f} KiB of {edge.MAX_JSON_CONTAINERS - 2} empty arrays",
                      lambda: edge.load_json(under)),
        "deep": ("load_json refusing 1M nested '['", lambda: edge.load_json(deep)),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (_what, fn) in cases.items():
            t0 = time.perf_counter()
            with contextlib.suppress(edge.BadMessage):
                fn()
            times[name].append(time.perf_counter() - t0)
    return {name: {"what": what, **summarise(times[name], DIGITS)} for name, (what, _fn) in cases.items()}


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
        print(f"{name:13s} p50 {row['p50']:8.3f} ms  p95 {row['p95']:8.3f}  p99 {row['p99']:8.3f}  "
              f"max {row['max']:8.3f}  (n={row['n']}; {row['what']})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
