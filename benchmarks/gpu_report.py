"""Merge a gpu_suite.sh run's JSON files into OUT/summary.json and print the key figures.

    python benchmarks/gpu_report.py OUT

Reads whichever of llm.json (or llm_ratio.json), llm_nocache.json, asr.json, tts.json,
probe_cost.json and pipeline/pipeline.json exist; computes the
ratios that need two files (prefix caching off/on TTFT at equal sessions).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def q(d: dict[str, Any], *keys: str) -> str:
    return "/".join(str(d.get(k)) for k in keys)


def summary(out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"device": (out / "device.txt").read_text().strip() if (out / "device.txt").exists() else None}
    llm = load(out / "llm.json") or load(out / "llm_ratio.json")
    nocache = load(out / "llm_nocache.json")
    scen: dict[str, dict[str, Any]] = {}
    for rep in (llm, nocache):
        for r in (rep or {}).get("scenarios", []):
            scen[r["name"]] = r
    if scen:
        res["llm"] = {
            name: {"sessions": r["sessions"], "driver": r.get("driver"), "turns": r["turns_measured"],
                   "ttft_ms": r["ttft_ms"], "tt10_ms": r["tt10_ms"], "hit": r["interactive_cache_hit"],
                   "errors": r["n_errors"], "loop_lag_p99_ms": r["loop_lag_ms"].get("p99"),
                   "api_cpu": r["api_process_cpu"], "bg_done": r.get("background", {}).get("completed")}
            for name, r in scen.items()
        }
        ratios = dict((llm or {}).get("ratios", {}))
        for name, r in scen.items():
            if name.startswith("nocache/interactive-"):
                n = name.rsplit("-", 1)[1]
                on = scen.get(f"main/interactive-{n}")
                if on:
                    ratios[f"prefix_cache_off_over_on_ttft_{n}"] = {
                        k: round(r["ttft_ms"][k] / on["ttft_ms"][k], 1) for k in ("p50", "p95") if on["ttft_ms"].get(k)
                    } | {"ms": [q(r["ttft_ms"], "p50", "p95"), q(on["ttft_ms"], "p50", "p95")]}
        res["llm_ratios"] = ratios
        res["llm_engine_start_s"] = {**(llm or {}).get("phase_engine_start_s", {}),
                                     **(nocache or {}).get("phase_engine_start_s", {})}
    asr = load(out / "asr.json")
    if asr:
        res["asr"] = {
            "engine_start_s": asr.get("engine_start_s"),
            "burst": asr.get("burst"),
            "scenarios": [
                {k: r[k] for k in ("streams", "partial_interval_ms", "finals_measured", "final_after_eos_ms",
                                   "final_after_call_ms", "final_within_300ms", "partial_lag_ms", "decodes_per_s",
                                   "dropped_partials", "n_errors", "peak", "api_process_cpu", "meets_target")}
                | {"loop_lag_p99_ms": r["loop_lag_ms"].get("p99")}
                for r in asr.get("scenarios", [])
            ],
        }
    tts = load(out / "tts.json")
    if tts:
        res["tts"] = tts.get("scenarios", [])
    cost = load(out / "probe_cost.json")
    if cost:
        res["probe_cost"] = [{k: lv[k] for k in ("sessions", "ok", "turns", "timing_error_ms", "probe")}
                             for lv in cost.get("levels", [])]
    pipe = load(out / "pipeline" / "pipeline.json")
    if pipe:
        res["pipeline"] = {"sessions_per_gpu": pipe.get("sessions_per_gpu"),
                           "levels": [{k: v for k, v in lv.items() if k != "dropped_reasons"}
                                      for lv in pipe.get("levels", [])]}
    return res


def main() -> int:
    out = Path(sys.argv[1])
    s = summary(out)
    (out / "summary.json").write_text(json.dumps(s, indent=2))
    print(f"device: {s.get('device')}")
    for name, r in s.get("llm", {}).items():
        print(f"llm {name:<28} TTFT p50/p95 {q(r['ttft_ms'], 'p50', 'p95'):>14}  TT10 p50/p95 "
              f"{q(r['tt10_ms'], 'p50', 'p95'):>14}  hit {r['hit']}  errors {r['errors']}")
    for k, v in s.get("llm_ratios", {}).items():
        print(f"ratio {k}: {v}")
    for r in s.get("asr", {}).get("scenarios", []):
        print(f"asr {r['streams']:>4} streams partial {r['partial_interval_ms']} ms: final after EOS "
              f"{q(r['final_after_eos_ms'], 'p50', 'p95', 'p99')} ms, {r['decodes_per_s']} decodes/s, "
              f"dropped {r['dropped_partials']}, ok {r['meets_target']}")
    for r in s.get("tts", []):
        print(f"tts workers {r['workers']} sessions {r['sessions']:>4}: first audio "
              f"{q(r['first_audio_ms'], 'p50', 'p95')} ms, stalled {r['stalled_fraction']}")
    for r in s.get("probe_cost", []):
        e, p = r["timing_error_ms"], r["probe"]
        print(f"probe {r['sessions']:>5} sessions: ok {r['ok']}/{r['turns']}, error p50/p95/p99 "
              f"{q(e, 'p50', 'p95', 'p99')} ms, {p['cores']} cores ({p['cpu_per_session_pct']}% core/session)")
    for lv in s.get("pipeline", {}).get("levels", []):
        print(f"pipeline N={lv['sessions']:>4}: v2v p50/p95/p99 {q(lv['v2v_ms'], 'p50', 'p95', 'p99')} ms, "
              f"stage p95 {lv['stage_p95_ms']}, dropped {lv['dropped_sessions']}, fails {lv.get('fails')}")
    if "pipeline" in s:
        print(f"sessions per GPU: {s['pipeline']['sessions_per_gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
