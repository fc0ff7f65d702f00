"""Percentiles per concurrency level, the printed table, the JSON and the plot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from voicebot.probe.measure import percentiles
from voicebot.probe.turn import TurnRecord

# turn.timings fields reported as stages, in pipeline order.
STAGES = (
    "endpointing_ms",
    "asr_final_ms",
    "llm_ttft_ms",
    "first_clause_ms",
    "tts_first_audio_ms",
    "voice_to_voice_ms",  # the server's own view, to compare with the measured one
)


# A gap between reply chunks this long is a stall the caller hears: the server paces
# 20 ms frames 120 ms ahead (session.playout_lead_ms), so on time they never gap this much.
STALL_GAP_MS = 150.0


def summarize(records: list[TurnRecord]) -> dict[str, Any]:
    """Latency of every turn with a measured value (a turn with a non-fatal error
    event still measured a real latency); counts say how many turns went wrong."""
    stages = {
        s: percentiles(r.timings[s] for r in records if isinstance(r.timings.get(s), int | float))
        for s in STAGES
    }
    out: dict[str, Any] = {
        "counts": {
            "turns": len(records),
            "ok": sum(r.status == "ok" for r in records),
            "failed": sum(r.status == "failed" for r in records),
            "timeout": sum(r.status == "timeout" for r in records),
            # turns where the server spoke over the caller / ended their turn early
            "talked_over": sum(r.overlap_ms > 0 for r in records),
            "early_ends": sum(r.early_ends > 0 for r in records),
        },
        "voice_to_voice_ms": percentiles(
            r.voice_to_voice_ms for r in records if r.voice_to_voice_ms is not None
        ),
        "stages_ms": stages,
        # reply audio / its arrival span per turn, in %: under 100, the caller heard it stall
        "reply_rtf_pct": percentiles(
            100.0 * r.reply_audio_ms / r.reply_span_ms
            for r in records
            if r.reply_audio_ms is not None and r.reply_span_ms
        ),
        "stalled_replies": sum(
            r.reply_max_gap_ms is not None and r.reply_max_gap_ms > STALL_GAP_MS for r in records
        ),
    }
    # Where stalled replies stalled: the reply audio heard before their longest gap (ms).
    stalls = [r.reply_max_gap_at_ms for r in records if r.reply_max_gap_ms is not None
              and r.reply_max_gap_ms > STALL_GAP_MS and r.reply_max_gap_at_ms is not None]
    if stalls:
        out["stall_at_ms"] = percentiles(stalls)
    barged = [r.barge_in for r in records if r.barge_in is not None]
    if barged:
        out["barge_in_ms"] = {
            "event": percentiles(b["event_ms"] for b in barged if b["event_ms"] is not None),
            "playout_stop": percentiles(
                b["playout_stop_ms"] for b in barged if b["playout_stop_ms"] is not None
            ),
        }
    backchannels = [r.backchannel for r in records if r.backchannel is not None]
    if backchannels:
        out["backchannel"] = {
            "resumed": sum(bool(b["resumed"]) for b in backchannels),
            "n": len(backchannels),
            "paused_ms": percentiles(b["paused_ms"] for b in backchannels if b["resumed"]),
        }
    return out


def build_report(
    config: dict[str, Any],
    levels: list[tuple[int, list[TurnRecord]]],
    probe: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``probe``: the probe's own cost per level (ProbeStats.as_dict), if measured."""
    merged = [r for _, recs in levels for r in recs]
    level_out = [
        {"sessions": n, **summarize(recs), "turns": [asdict(r) for r in recs]} for n, recs in levels
    ]
    for lv, cost in zip(level_out, probe or [], strict=False):
        lv["probe"] = cost
    return {
        "config": config,
        **summarize(merged),
        "turns": [{"sessions": n, **asdict(r)} for n, recs in levels for r in recs],
        "levels": level_out,
    }


def _ms(value: float | int | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_table(report: dict[str, Any]) -> str:
    head = f"{'sessions':>8} {'ok/turns':>9} {'v2v p50':>8} {'p90':>6} {'p95':>6} {'p99':>6} {'max':>6}"
    head += "".join(f" {s.removesuffix('_ms')[:10]:>10}" for s in STAGES[:-1])
    lines = [head + "   (ms; stage columns are p50 of turn.timings)"]
    for lv in report["levels"]:
        v, c = lv["voice_to_voice_ms"], lv["counts"]
        row = f"{lv['sessions']:>8} {str(c['ok']) + '/' + str(c['turns']):>9} {_ms(v['p50']):>8}"
        row += "".join(f" {_ms(v[k]):>6}" for k in ("p90", "p95", "p99", "max"))
        row += "".join(f" {_ms(lv['stages_ms'][s]['p50']):>10}" for s in STAGES[:-1])
        lines.append(row)
        if "probe" in lv:
            pr = lv["probe"]
            lines.append(
                f"{'':>8} probe: {pr['workers']} process(es), {pr['cores']} cores"
                f" ({pr['cpu_per_session_pct']}% of a core per session), frame clock late"
                f" p99 {_ms(pr['tick_late_ms']['p99'])} ms, {pr['skipped_frames']} frames held back"
            )
        if "barge_in_ms" in lv:
            b = lv["barge_in_ms"]
            lines.append(
                f"{'':>8} barge-in: barge_in event p50 {_ms(b['event']['p50'])} p95 {_ms(b['event']['p95'])}"
                f", playout stop p50 {_ms(b['playout_stop']['p50'])} p95 {_ms(b['playout_stop']['p95'])}"
                f" (n={b['playout_stop']['n']})"
            )
        if "backchannel" in lv:
            b = lv["backchannel"]
            lines.append(
                f"{'':>8} backchannel: reply went on {b['resumed']} of {b['n']}, paused p50"
                f" {_ms(b['paused_ms']['p50'])} p95 {_ms(b['paused_ms']['p95'])} max {_ms(b['paused_ms']['max'])}"
            )
    failed = [t for t in report["turns"] if t["status"] != "ok"]
    for t in failed[:10]:
        lines.append(
            f"  {t['status']}: sessions={t['sessions']} s{t['session']} t{t['turn']} {t['audio']}: {'; '.join(t['errors'])}"
        )
    if len(failed) > 10:
        lines.append(f"  ... {len(failed) - 10} more failed turns in the JSON")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Box plot and CDF of voice-to-voice latency per concurrency level."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt
    import numpy as np

    data = [
        (
            lv["sessions"],
            [t["voice_to_voice_ms"] for t in lv["turns"] if t["voice_to_voice_ms"] is not None],
        )
        for lv in report["levels"]
    ]
    data = [(n, v) for n, v in data if v]
    fig, (box, cdf) = plt.subplots(1, 2, figsize=(11, 4.5))
    if data:
        box.boxplot([v for _, v in data], showmeans=True)
        box.set_xticks(range(1, len(data) + 1), [str(n) for n, _ in data])
        for n, v in data:
            xs = np.sort(np.asarray(v))
            ys = np.arange(xs.size + 1) / xs.size  # starts at 0 so the first step shows
            cdf.step(
                np.concatenate([xs[:1], xs]), ys, where="post", label=f"{n} session(s), n={xs.size}"
            )
        cdf.legend()
    else:
        box.text(0.5, 0.5, "no measured turns", ha="center", transform=box.transAxes)
    box.set_xlabel("concurrent sessions")
    box.set_ylabel("voice-to-voice latency (ms)")
    box.set_title("latency per concurrency level")
    cdf.set_xlabel("voice-to-voice latency (ms)")
    cdf.set_ylabel("fraction of turns")
    cdf.set_title("CDF")
    cdf.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
