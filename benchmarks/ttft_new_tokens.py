"""Time to first token against the prompt tokens left to prefill, behind a cached prefix.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/ttft_new_tokens.py --config configs/default.yaml \
        --json artifacts/ttft_new_tokens.json

What a live turn's TTFT is made of on the configured engine: a prefix of ``--cached``
tokens is prefilled first (``LlmEngine.warm``, as the session does), then prompts that
extend it by N new tokens are timed, N in ``--new``, round robin for ``--reps`` rounds
(each prompt's new tokens are fresh words, so nothing of them is cached). The slope is
what each token of the caller's turn costs when it is prefilled after the end of speech
(``llm.warm_turn`` prefills most of them while the caller speaks), the intercept what a
prefill costs however short. Run it with the server's OpenMP settings in the environment
(``OMP_WAIT_POLICY=PASSIVE`` for the CPU default) to match a server. Prints a table and
writes JSON (ms: n, p50, p95, p99, mean, max per N; the least-squares line through the
medians).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

from bench_util import JSON_EPILOG, summarise, write_result  # same folder

from voicebot.config import load_config
from voicebot.engines.contracts import GenerationStats, Lane
from voicebot.engines.llm.inprocess import LlmEngine
from voicebot.provision import resolve_model

WORDS = (
    "table window garden river morning ticket station evening weather question answer booking "
    "dinner family number office letter music paper corner street market bridge harbour"
).split()


def fresh_words(tok: object, n: int, rng: random.Random) -> list[int]:
    """``n`` token ids of words no earlier prompt had at this place."""
    text = " " + " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 9999)}" for _ in range(n))
    return list(tok.encode(text, add_special_tokens=False))[:n]  # type: ignore[attr-defined]


async def run(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config, args.overrides)
    engine = LlmEngine(cfg.llm, resolve_model(cfg.llm.model, cfg.models))
    await engine.start()
    rng = random.Random(args.seed)
    tok = engine.tokenizer
    times: dict[int, list[float]] = {n: [] for n in args.new}
    try:
        prefix = fresh_words(tok, args.cached * 2, rng)[: args.cached]
        await engine.warm(prefix)
        for _ in range(args.reps):
            for n in args.new:
                st = GenerationStats("", Lane.INTERACTIVE)
                t0 = time.monotonic()
                await engine.complete(prefix + fresh_words(tok, n, rng), max_tokens=1, temperature=0.0, stats=st)
                times[n].append(time.monotonic() - t0)
                if st.cached_tokens < args.cached // engine.block_size * engine.block_size:
                    print(f"[ttft_new_tokens] N={n}: only {st.cached_tokens} tokens cached", file=sys.stderr)
    finally:
        await engine.aclose()
    rows = {n: summarise(v) for n, v in times.items()}
    xs = list(rows)
    ys = [rows[n]["p50"] for n in xs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    return {
        "config": args.config,
        "overrides": args.overrides,
        "cached_tokens": args.cached,
        "block_size": engine.block_size,
        "ttft_ms_by_new_tokens": rows,
        "fit_ms": {"per_token": round(slope, 2), "intercept": round(my - slope * mx, 1)},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override KEY=VALUE")
    p.add_argument("--cached", type=int, default=512, help="tokens of cached prefix")
    p.add_argument("--new", type=int, nargs="+", default=[1, 8, 16, 24, 32, 48, 64])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    report = asyncio.run(run(args))
    print(f"{'new tokens':>11} {'p50':>8} {'p95':>8}   (ms, {args.reps} each, {args.cached} cached)")
    for n, row in report["ttft_ms_by_new_tokens"].items():
        print(f"{n:>11} {row['p50']:>8.0f} {row['p95']:>8.0f}")
    fit = report["fit_ms"]
    print(f"fit through the medians: {fit['intercept']:.0f} ms + {fit['per_token']:.1f} ms per new token")
    write_result(args.json, "ttft_new_tokens", args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
