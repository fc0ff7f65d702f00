"""The first turn after new instructions: prefilled with the turn, or before it (llm.warm_prefix).

    flock /tmp/heavy.lock .venv/bin/python benchmarks/prefix_warm.py --config configs/default.yaml \
        --reps 5 --json artifacts/prefix_warm.json

A Realtime client opens a call with its own instructions and tools (session.update): a
system message of hundreds of tokens that no other call shares. Each repetition builds
one such conversation (a fresh random word in it, so no repetition reuses another's
blocks) with the session's own Conversation, then measures the first turn's time to
first token on the real engine:

    cold    the turn's prompt as it comes, the whole system message prefilled with it;
    warmed  Session's warm-up first (LlmEngine.warm of the history, as the session does
            when the instructions arrive), then the same turn.

Prints the system message's length, the warm-up's own time and both TTFTs (p50 / p95 /
max), and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import sys
import time
from pathlib import Path

from bench_util import summarise  # same folder

from voicebot.config import load_config
from voicebot.engines.contracts import GenerationStats, Lane
from voicebot.engines.llm.inprocess import LlmEngine
from voicebot.provision import resolve_model
from voicebot.session.history import Conversation

INSTRUCTIONS = (
    "You are the phone assistant of the Lighthouse Inn, a small hotel by the sea. Speak in short "
    "sentences, one or two at a time; never read out lists longer than three items. Rooms: twelve "
    "doubles, four singles and two family rooms; check-in from three in the afternoon, check-out by "
    "eleven. Breakfast is served from seven to ten. Dogs are welcome in the ground-floor rooms for a "
    "fee. When a caller wants to book, ask for the dates, the number of guests and a name, then call "
    "the booking tool. Never promise a room the tool has not confirmed. "
)
TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": list(props)},
    }}
    for name, description, props in (
        ("check_availability", "Free rooms for a stay.",
         {"arrival": {"type": "string", "description": "ISO date"},
          "nights": {"type": "integer"}, "guests": {"type": "integer"}}),
        ("book_room", "Book a room that check_availability offered.",
         {"room_id": {"type": "string"}, "name": {"type": "string"}, "phone": {"type": "string"}}),
        ("cancel_booking", "Cancel a booking by its reference.", {"reference": {"type": "string"}}),
    )
]
QUESTION = "Hi, do you have a double room free this Friday for two nights?"


async def ttft(engine: LlmEngine, ids: list[int]) -> GenerationStats:
    st = GenerationStats("", Lane.INTERACTIVE)
    await engine.complete(ids, max_tokens=1, temperature=0.0, stats=st)
    return st


async def run(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config)
    engine = LlmEngine(cfg.llm, resolve_model(cfg.llm.model, cfg.models))
    await engine.start()
    rows: list[dict] = []
    try:
        await ttft(engine, engine.tokenizer.encode("Warm up the engine."))
        for rep in range(args.reps):
            for mode in ("cold", "warmed"):
                salt = "".join(random.choices(string.ascii_lowercase, k=12))
                conv = Conversation(engine.tokenizer, f"Call reference {salt}. {INSTRUCTIONS}",
                                    cfg.session.history_tokens, cfg.llm.max_tokens)
                conv.set_tools(TOOLS)
                warm_s = None
                if mode == "warmed":
                    t0 = time.monotonic()
                    await engine.warm(conv.history_ids())
                    warm_s = time.monotonic() - t0
                st = await ttft(engine, conv.prompt_ids(QUESTION))
                assert st.ttft_s is not None
                row = {"rep": rep, "mode": mode, "system_tokens": len(conv.history_ids()),
                       "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens,
                       "ttft_s": round(st.ttft_s, 4), "warm_s": None if warm_s is None else round(warm_s, 4)}
                rows.append(row)
                print(f"[prefix_warm] {row}", flush=True)
    finally:
        await engine.aclose()
    report: dict = {"config": args.config, "reps": args.reps, "rows": rows}
    for mode in ("cold", "warmed"):
        report[mode] = {"ttft_ms": summarise([r["ttft_s"] for r in rows if r["mode"] == mode])}
    report["warmed"]["warm_ms"] = summarise([r["warm_s"] for r in rows if r["mode"] == "warmed"])
    report["system_tokens"] = rows[0]["system_tokens"] if rows else None
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    report = asyncio.run(run(args))
    print(f"system message: {report['system_tokens']} tokens")
    for mode in ("cold", "warmed"):
        t = report[mode]["ttft_ms"]
        print(f"{mode:>7}: first turn TTFT p50 {t.get('p50')} / p95 {t.get('p95')} / max {t.get('max')} ms (n {t['n']})")
    w = report["warmed"]["warm_ms"]
    print(f"warm-up itself (before the turn, while nobody waits): p50 {w.get('p50')} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
