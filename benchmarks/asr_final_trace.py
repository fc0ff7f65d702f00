"""Where each turn's ASR final goes, from a traced run (``TRACE=1 benchmarks/voice_loop.sh``).

    .venv/bin/python benchmarks/asr_final_trace.py OUT/trace.jsonl [--json OUT.json]

The reply's LLM request goes out the moment the turn's final transcript is ready, so
the ASR stage on the critical path is QUIET (the VAD's first quiet windows after the
last word: the final's decode is asked for here) -> the interactive LLM request. For
each turn this prints that span split into:

    wait     a decode already running at QUIET that had not seen the end of speech
             (an interval partial that started just before it): its remaining time
             ("stopped": it was abandoned before its decoder, the trace's
             ``error: DecodeAbandoned``)
    decode   the decode whose result became the final (start -> end)
    gap      the rest (the event loop, the session's bookkeeping)

and what ran beside the final's decode: Smart Turn's inference, a background LLM
request (history prefill or summary), TTS. Which decode was "the final" is read from
the timing: the last Whisper decode that ended before the LLM request was submitted.
If it started before QUIET, a partial already covered the end of speech (no wait).

``asr_final_ms`` in ``turn.timings`` is not this span: it runs from PAUSE to the
moment the committed turn reads the transcript, i.e. it also holds the wait for the
end of turn (Smart Turn's 1.5 s cap on an unfinished sentence). This script is the
stage as the reply sees it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench_util import summarise  # same folder


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def turns(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    signals = sorted((e for e in events if e["kind"] == "signal"), key=lambda e: e["at"])
    asr = sorted((e for e in events if e["kind"] == "asr"), key=lambda e: e["start"])
    llm = sorted((e for e in events if e["kind"] == "llm"), key=lambda e: e["submitted"])
    inter = [e for e in llm if e["lane"] == "interactive"]
    side = [e for e in events if e["kind"] in ("smart_turn", "tts")]
    side += [{**e, "kind": "llm:" + e["lane"], "start": e["submitted"]} for e in llm if e["lane"] != "interactive"]
    out = []
    for req in inter:
        sub = req["submitted"]
        # the QUIET this request answers: the last one before it
        quiets = [s for s in signals if s["name"] == "quiet" and s["at"] <= sub]
        if not quiets:
            continue
        quiet = quiets[-1]["at"]
        if sub - quiet > 5.0:
            continue  # not a reply to speech (a tool round, a text turn)
        done = [d for d in asr if d["end"] <= sub + 0.005 and "error" not in d]
        if not done:
            continue
        final = done[-1]
        running = [d for d in asr if d["start"] < quiet < d["end"] and d is not final]
        wait = 0.0
        stopped = False
        if running and final["start"] >= quiet:
            wait = running[-1]["end"] - quiet
            stopped = running[-1].get("error") == "DecodeAbandoned"
        t0 = max(final["start"], quiet)
        beside: dict[str, float] = {}
        for w in side:
            ov = _overlap(final["start"], final["end"], w["start"], w["end"])
            if ov > 0:
                beside[w["kind"]] = round(beside.get(w["kind"], 0.0) + 1000 * ov, 1)
        later = [s for s in signals if quiet < s["at"] <= sub + 3.0]
        end = next((s["at"] for s in later if s["name"] == "end"), None)
        out.append({
            "rid": req["rid"],
            "quiet_to_llm_ms": round(1000 * (sub - quiet), 1),
            "wait_ms": round(1000 * wait, 1),
            "wait_stopped": stopped,
            "final_decode_ms": round(1000 * (final["end"] - final["start"]), 1),
            "final_started": "before quiet (a covering partial)" if final["start"] < quiet else "after quiet",
            "final_audio_s": final["audio_s"],
            "gap_ms": round(1000 * (sub - final["end"]), 1),
            "from_quiet_in_final_ms": round(1000 * (final["end"] - t0), 1),
            "beside_final_ms": beside,
            "quiet_to_end_ms": None if end is None else round(1000 * (end - quiet), 1),
            "ttft_ms": round(1000 * (req["first_token"] - sub), 1) if "first_token" in req else None,
            "signals": [s["name"] for s in later if s["at"] <= sub],
        })
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    events = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    rows = turns(events)
    print("(wait: s = the decode waited for was stopped before its decoder)")
    print(f"{'rid':>5} {'quiet->llm':>10} {'wait':>6} {'decode':>7} {'gap':>5} {'audio s':>7} {'quiet->end':>10}"
          f" {'ttft':>6}  final / beside its decode (ms)")
    for r in rows:
        beside = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["beside_final_ms"].items())) or "-"
        qe = "-" if r["quiet_to_end_ms"] is None else f"{r['quiet_to_end_ms']:.0f}"
        wait = f"{r['wait_ms']:.0f}" + ("s" if r["wait_stopped"] else "")
        print(f"{r['rid']:>5} {r['quiet_to_llm_ms']:>10.0f} {wait:>6} {r['final_decode_ms']:>7.0f}"
              f" {r['gap_ms']:>5.0f} {r['final_audio_s']:>7.2f} {qe:>10} {r['ttft_ms'] or 0:>6.0f}"
              f"  {r['final_started']}; {beside}")
    summary = {
        "turns": len(rows),
        "quiet_to_llm_ms": summarise([r["quiet_to_llm_ms"] / 1000 for r in rows]),
        "wait_ms": summarise([r["wait_ms"] / 1000 for r in rows]),
        "final_decode_ms": summarise([r["final_decode_ms"] / 1000 for r in rows]),
        "waited_turns": sum(1 for r in rows if r["wait_ms"] > 0),
        "waits_stopped": sum(1 for r in rows if r["wait_stopped"]),
        # every decode of the run stopped before its end (stale partials; speculations included)
        "decodes_abandoned": sum(1 for e in events if e["kind"] == "asr" and e.get("error") == "DecodeAbandoned"),
        "covered_before_quiet": sum(1 for r in rows if r["final_started"].startswith("before")),
        "smart_turn_beside_final": sum(1 for r in rows if "smart_turn" in r["beside_final_ms"]),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "turns": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
