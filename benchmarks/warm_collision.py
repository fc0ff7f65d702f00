"""A live turn that arrives during a long background prefill: how long its first token waits.

    OMP_WAIT_POLICY=PASSIVE flock /tmp/heavy.lock .venv/bin/python benchmarks/warm_collision.py \
        --json artifacts/warm_collision.json

The session prefills at background priority while nobody waits (llm.warm_prefix): after a
reply, at the call's start, and the history a compaction leaves (session.history_tokens:
~825 tokens at the default budget, none of them cached). The engine runs one step at a
time and an abort takes effect after its step, so a caller whose turn ends during such a
prefill waits for the step in flight. ``llm.warm_piece_tokens`` sends it in pieces.

For each piece size (0: the whole prefill as one request), each repetition: a cached
prefix of ``--cached`` tokens; a prefill of ``--warm`` fresh tokens after it starts; after
``--after`` seconds (round robin) the session's move is made: the prefill is cancelled and
a live prompt (the prefix and ``--live`` fresh tokens) is sent at interactive priority.
Timed: that prompt's first token from the cancellation, and the prefill alone, not
interrupted. Prints a table and writes JSON (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from pathlib import Path

from bench_util import summarise  # same folder
from ttft_new_tokens import fresh_words  # same folder

from voicebot.config import load_config
from voicebot.engines.contracts import GenerationStats, Lane
from voicebot.engines.llm.inprocess import LlmEngine
from voicebot.provision import resolve_model


async def run(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config, args.overrides)
    engine = LlmEngine(cfg.llm, resolve_model(cfg.llm.model, cfg.models))
    await engine.start()
    rng = random.Random(args.seed)
    tok = engine.tokenizer
    rows: dict[int, dict] = {}
    try:
        for piece in args.pieces:
            engine.cfg = engine.cfg.model_copy(update={"warm_piece_tokens": piece})
            waits: list[float] = []
            alone: list[float] = []
            for rep in range(args.reps):
                prefix = fresh_words(tok, args.cached * 2, rng)[: args.cached]
                await engine.warm(prefix)
                t0 = time.monotonic()
                await engine.warm(prefix + fresh_words(tok, args.warm, rng))
                alone.append(time.monotonic() - t0)
                for after in args.after:
                    prefix = fresh_words(tok, args.cached * 2, rng)[: args.cached]
                    await engine.warm(prefix)
                    task = asyncio.create_task(engine.warm(prefix + fresh_words(tok, args.warm, rng)))
                    await asyncio.sleep(after)
                    t0 = time.monotonic()
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    st = GenerationStats("", Lane.INTERACTIVE)
                    await engine.complete(prefix + fresh_words(tok, args.live, rng), max_tokens=1,
                                          temperature=0.0, stats=st)
                    waits.append(time.monotonic() - t0)
                print(f"[warm_collision] piece {piece}: rep {rep + 1} done", file=sys.stderr)
            rows[piece] = {"live_ttft_ms": summarise(waits), "prefill_alone_ms": summarise(alone)}
    finally:
        await engine.aclose()
    return {"config": args.config, "overrides": args.overrides, "cached": args.cached, "warm": args.warm,
            "live": args.live, "after_s": args.after, "block_size": engine.block_size, "by_piece": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override KEY=VALUE")
    p.add_argument("--pieces", type=int, nargs="+", default=[0, 256])
    p.add_argument("--cached", type=int, default=64, help="tokens of cached prefix")
    p.add_argument("--warm", type=int, default=800, help="fresh tokens the background prefill computes")
    p.add_argument("--live", type=int, default=30, help="fresh tokens of the live prompt")
    p.add_argument("--after", type=float, nargs="+", default=[0.5, 1.5, 2.5, 3.5])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    report = asyncio.run(run(args))
    n = args.reps * len(args.after)
    print(f"{'piece':>6} {'live TTFT p50':>14} {'p95':>7} {'max':>7} {'prefill alone p50':>18}"
          f"   (ms; {n} live turns each, {args.warm} tokens prefilling)")
    for piece, row in report["by_piece"].items():
        live, alone = row["live_ttft_ms"], row["prefill_alone_ms"]
        print(f"{piece:>6} {live['p50']:>14.0f} {live['p95']:>7.0f} {live['max']:>7.0f} {alone['p50']:>18.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
