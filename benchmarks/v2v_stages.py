"""Where the voice-to-voice milliseconds go, turn by turn, from a probe report.

    .venv/bin/python benchmarks/v2v_stages.py artifacts/v2v/probe.json [--json OUT.json]

The probe measures voice-to-voice from the audio (end of the caller's speech -> first
audible reply block); the server's ``turn.timings`` of the same turn split it into
stages that follow each other on the critical path of a speculative reply:

    pause      end of speech -> the reply is started: VAD lag + ``vad.speculative_silence_ms``
               (the final's decode already runs from the first silent window on)
    asr        the reply waits for the final transcript (``asr_final_ms``)
    ttft       LLM prompt -> first token (``llm_ttft_ms``)
    clause     first token -> first clause cut (``first_clause_ms - llm_ttft_ms``)
    tts        first clause -> its first audio (``tts_first_audio_ms``)
    rest       v2v minus all of the above: pacing, the wire, the probe's onset detection

``pause`` and ``rest`` are not measured apart (only their sum is known); ``pause + rest``
is reported as one column.

``uncached`` (tokens, not ms) is the part of the reply's prompt that vLLM's prefix cache
did not hold: what the TTFT had to prefill.

Several probe reports are pooled into one table (back-to-back runs of one setting).
``--uncapped MS`` prints the table a second time over the turns whose endpointing took
less than MS (Smart Turn's cap is 1500 ms: those turns did not wait for it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench_util import JSON_EPILOG, pct, write_result  # benchmarks/, beside this file

COLUMNS = ("v2v", "asr", "ttft", "clause", "tts", "pause+rest", "uncached")


def stages(turn: dict[str, Any]) -> dict[str, float] | None:
    t = turn.get("timings") or {}
    v2v = turn.get("voice_to_voice_ms")
    need = ("asr_final_ms", "llm_ttft_ms", "first_clause_ms", "tts_first_audio_ms")
    if v2v is None or any(t.get(k) is None for k in need):
        return None
    row = {
        "v2v": v2v,
        "asr": t["asr_final_ms"],
        "ttft": t["llm_ttft_ms"],
        "clause": t["first_clause_ms"] - t["llm_ttft_ms"],
        "tts": t["tts_first_audio_ms"],
    }
    row["pause+rest"] = v2v - row["asr"] - row["ttft"] - row["clause"] - row["tts"]
    # The counts as response.done gave them (the probe's record); turn.timings only where
    # the engine knew them at the first audio (older reports).
    prompt = turn.get("prompt_tokens") or t.get("prompt_tokens") or 0
    cached = turn.get("cached_tokens") if turn.get("prompt_tokens") else t.get("cached_prompt_tokens")
    row["uncached"] = prompt - (cached or 0)
    return row


def table(rows: list[dict[str, float]], title: str = "") -> dict[str, Any]:
    print(f"{'':>5}" + "".join(f"{c:>11}" for c in COLUMNS) + f"   (ms; uncached: tokens; n={len(rows)}{title})")
    out: dict[str, Any] = {"n": len(rows)}
    for q, name in ((50, "p50"), (95, "p95")):
        values = {c: round(pct([r[c] for r in rows], q) or 0.0, 1) for c in COLUMNS}
        out[name] = values
        print(f"{name:>5}" + "".join(f"{values[c]:>11.0f}" for c in COLUMNS))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("probe_json", type=Path, nargs="+", help="one report, or several to pool")
    p.add_argument("--json", type=Path)
    p.add_argument("--uncapped", type=float, metavar="MS", help="also: only turns whose endpointing took < MS")
    args = p.parse_args()
    turns = [t for path in args.probe_json for t in json.loads(path.read_text())["turns"]]
    rows = [r for r in (stages(t) for t in turns) if r is not None]
    if not rows:
        print("no turn with complete timings", file=sys.stderr)
        return 1
    out = table(rows)
    # The p95 turns: which stage made them slow.
    slow = sorted(rows, key=lambda r: r["v2v"])[-max(1, len(rows) // 10):]
    out["slowest"] = slow
    for r in slow:
        print("slow " + "".join(f"{r[c]:>11.0f}" for c in COLUMNS))
    if args.uncapped is not None:
        kept = [
            r
            for r, t in ((stages(t), t) for t in turns)
            if r is not None and (t["timings"].get("endpointing_ms") or 0) < args.uncapped
        ]
        if kept:
            out["uncapped"] = table(kept, f", endpointing < {args.uncapped:g} ms")
    write_result(args.json, "v2v_stages", args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
