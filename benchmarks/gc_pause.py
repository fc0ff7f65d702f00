"""What a full garbage collection costs a server holding its engines, with and without
the loaded heap frozen (voicebot/server/gc_freeze.py).

    flock /tmp/heavy.lock .venv/bin/python benchmarks/gc_pause.py --config configs/default.yaml \
        --json artifacts/gc_pause/default.json

Loads the engines as ``voicebot serve`` does (``load_engines``), then times ``--reps``
full collections (``gc.collect()``: what CPython runs, on whichever thread allocates,
once the objects promoted since the last exceed a quarter of the long-lived ones), then
freezes the heap as the server now does and times them again. Prints and writes the
tracked-object counts and the pauses (p50 / max, ms).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from pathlib import Path

from bench_util import summarise  # same folder

from voicebot.config import load_config
from voicebot.engines import load_engines
from voicebot.server.gc_freeze import freeze_loaded_heap


def pauses_s(reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - t0)
    return out


async def main(args: argparse.Namespace) -> dict[str, object]:
    cfg = load_config(args.config, args.set)
    engines = await load_engines(cfg)
    try:
        tracked = len(gc.get_objects())
        before = pauses_s(args.reps)
        frozen = freeze_loaded_heap()
        after = pauses_s(args.reps)
        tracked_after = len(gc.get_objects())
        gc.unfreeze()
    finally:
        await engines.aclose()
    return {
        "config": str(args.config), "overrides": args.set, "python": sys.version.split()[0],
        "tracked_objects": tracked, "frozen_objects": frozen, "tracked_after_freeze": tracked_after,
        "full_collection_ms": {"unfrozen": summarise(before, 2), "frozen": summarise(after, 2)},
    }


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is needed
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    result = asyncio.run(main(ns))
    s = result["full_collection_ms"]
    print(f"tracked objects after load: {result['tracked_objects']:,}; frozen: {result['frozen_objects']:,}; "
          f"still tracked after the freeze: {result['tracked_after_freeze']:,}")
    for name in ("unfrozen", "frozen"):
        print(f"full collection, {name}: p50 {s[name]['p50']} ms, max {s[name]['max']} ms (n {s[name]['n']})")  # type: ignore[index]
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(result, indent=2))
