"""Soak and leak figures: N callers for M minutes, then overload.

    .venv/bin/python benchmarks/soak.py --sessions 2 --minutes 2 --json artifacts/soak.json

Starts its own server (``benchmarks/serverproc.py``: the real ``voicebot serve`` on a
config, default configs/test.yaml) so it can watch the process from outside. Then:

1. Warm-up: one call per protocol, then a baseline sample with nothing running.
2. Soak: ``--sessions`` callers, each placing call after call for ``--minutes``: a
   random protocol, 1-3 turns of real speech through the probe (voicebot/probe), a
   barge-in on some turns, and some calls dropped abruptly mid-turn (TCP abort, no
   close frame, no session.end). Every ``--sample-s`` a row: RSS of the server's
   process tree, open descriptors, threads, live asyncio tasks, sessions and vLLM's
   unfinished requests.
3. Quiet: the last caller gone, the server must come back to the baseline: 0
   sessions, 0 vLLM requests, the same tasks and descriptors.
4. Overload (``--overload-turns`` > 0): ``capacity`` callers alone, then ``2 x
   capacity`` at once; every excess caller must be refused with ``capacity_exceeded``
   and the admitted ones' voice-to-voice p95 is compared with the first run's.

Memory: a linear fit of RSS over the soak after ``--warmup-s``, in MB per hour and per
session-hour (divided by the callers); and the growth of the idle RSS from before the
first call (a sample right after start-up, before the warm-up calls) to the end (idle,
``--end-settle-s`` after the last call, so past a heap trim), nothing left out.
``--allocator`` picks the allocator settings the server runs with, to compare them.
Writes JSON; prints a table; the exit code is 1 when a leak target is missed
(``--strict``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import JSON_EPILOG, write_result  # noqa: E402
from serverproc import ROOT, SERVER_SET, ServerProcess  # noqa: E402

from voicebot.probe.client import ProbeConfig, _Session, run_level  # noqa: E402
from voicebot.probe.clips import Clip, load_clip  # noqa: E402
from voicebot.probe.measure import percentiles  # noqa: E402
from voicebot.probe.turn import TurnRecord  # noqa: E402

DEFAULT_AUDIO = ["goforward.wav", "librivox_0880.wav", "librivox_0930.wav"]
PROTOCOLS = ("native", "realtime", "twilio", "webrtc")
# The allocator settings a run's server has (config overrides, environment):
# - server: its own (server.malloc_arena_max: glibc's arenas capped in the server
#   process at start-up; server.heap_trim_interval_s: malloc_trim after calls end);
# - server+env: those, and MALLOC_ARENA_MAX in the environment, which also reaches
#   vLLM's engine core (a child process the server's own setting does not touch);
# - glibc: none of them, glibc's defaults (8 arenas per core, no trim).
ALLOCATORS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "server": ((), {}),
    "server+env": ((), {"MALLOC_ARENA_MAX": "2"}),
    "glibc": (("server.malloc_arena_max=0", "server.heap_trim_interval_s=0"), {}),
}


def server_env(allocator: str) -> dict[str, str]:
    """This environment without glibc's malloc tunables, plus the allocator's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    return {**env, **ALLOCATORS[allocator][1]}


def url_for(server: ServerProcess, protocol: str) -> str:
    return {"native": server.ws + "/ws", "realtime": server.ws + "/v1/realtime",
            "twilio": server.ws + "/twilio", "webrtc": server.http}[protocol]


def default_audio() -> list[str]:
    shared = ROOT.parent / "shared" / "audio"
    return [str(shared / name) for name in DEFAULT_AUDIO if (shared / name).is_file()]


def abort_connection(session: _Session) -> bool:
    """Drop the caller's connection the rude way: no close frame, no session.end."""
    ws = getattr(session.client, "_ws", None)
    transport = getattr(ws, "transport", None)
    if transport is not None:
        transport.abort()
        return True
    return False


class Soak:
    def __init__(self, args: argparse.Namespace, server: ServerProcess, clips: tuple[Clip, ...]) -> None:
        self.args, self.server, self.clips = args, server, clips
        self.rng = random.Random(args.seed)
        self.samples: list[dict[str, Any]] = []
        self.missed_samples: list[str] = []  # samples the server did not answer in time
        # Each sample is also appended here as it is taken: an hour's run that dies at
        # the end keeps its memory curve (one did: a sample timed out, nothing was written).
        self.samples_log = Path(args.json).with_suffix(".samples.jsonl")
        self.samples_log.parent.mkdir(parents=True, exist_ok=True)
        self.samples_log.write_text("")
        self.records: list[TurnRecord] = []
        self.turns: list[dict[str, Any]] = []  # what the JSON keeps of each turn
        self.calls = {"placed": 0, "completed": 0, "dropped": 0, "failed": 0, "barge_turns": 0}
        self.failures: list[str] = []
        # Idle checkpoints (--checkpoint-min): callers finish their call and wait while
        # the server goes idle, so its RSS is sampled with nothing in flight.
        self.running = asyncio.Event()
        self.running.set()
        self.in_call = 0
        self.no_call = asyncio.Event()  # set while no caller is in a call
        self.no_call.set()
        self.checkpoints: list[dict[str, Any]] = []
        self.call_time_s = 0.0  # caller-seconds spent in calls (session-hours for the slope)

    def probe_config(self, protocol: str, turns: int, barge: bool) -> ProbeConfig:
        return ProbeConfig(
            url=url_for(self.server, protocol), clips=self.clips, turns=turns, protocol=protocol,
            stagger_s=0.0, gap_s=0.3, timeout_s=self.args.turn_timeout_s, connect_timeout_s=10.0,
            barge_after_s=0.25 if barge else None,
        )

    async def caller(self, index: int, stop_at: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        first = True
        while True:
            await self.running.wait()
            if time.monotonic() >= stop_at:
                break
            self.in_call += 1
            self.no_call.clear()
            began = time.monotonic()
            try:
                await self.one_call(rng, index, first)
            finally:
                self.in_call -= 1
                if not self.in_call:
                    self.no_call.set()
                self.call_time_s += time.monotonic() - began
            first = False

    async def one_call(self, rng: random.Random, index: int, first: bool) -> None:
        protocol = rng.choice(self.args.protocols)
        turns = rng.randint(1, 3)
        barge = rng.random() < self.args.barge_prob
        drop = rng.random() < self.args.drop_prob
        if first:
            # However short the run, both happen: caller 0 barges in, caller 1 drops.
            barge, drop = index % 2 == 0, index % 2 == 1
            latest = 2.5  # while the caller is still speaking: surely before the call ends
        else:
            latest = 2.5 * turns * 3.0
        session = _Session(self.probe_config(protocol, turns, barge), index, self.args.sessions)
        self.calls["placed"] += 1
        task = asyncio.create_task(session.run())
        if drop:
            # Somewhere in the call: while speaking, listening or being answered.
            await asyncio.wait([task], timeout=rng.uniform(0.5, latest))
            if not task.done():
                abort_connection(session)
                task.cancel()
                await asyncio.wait([task])
                self.calls["dropped"] += 1
                return
        records = await task
        self.records.extend(records)
        self.turns.extend({"protocol": protocol, "status": r.status, "v2v_ms": r.voice_to_voice_ms,
                           "barge_in": r.barge_in, "timings": r.timings, "errors": r.errors[:3]}
                          for r in records)
        self.calls["barge_turns"] += sum(r.barge_in is not None for r in records)
        bad = [r for r in records if r.status != "ok"]
        if bad:
            self.calls["failed"] += 1
            self.failures.append(f"{protocol}: " + "; ".join(sorted({e for r in bad for e in r.errors}))[:300])
        else:
            self.calls["completed"] += 1

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                sample = await asyncio.to_thread(self.server.sample)
            except (TimeoutError, OSError) as exc:  # a slow moment is a missed sample, not the end
                self.missed_samples.append(f"{time.time():.0f}: {type(exc).__name__}: {exc}")
            else:
                self.samples.append(sample)
                with self.samples_log.open("a") as f:
                    f.write(json.dumps(sample, default=str) + "\n")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.args.sample_s)

    async def warm_up(self) -> dict[str, Any]:
        for protocol in self.args.protocols:
            records = await run_level(self.probe_config(protocol, 1, False), 1)
            if records[0].status != "ok":
                raise RuntimeError(f"warm-up call over {protocol} failed: {records[0].errors}")
        await asyncio.sleep(2.0)
        return await asyncio.to_thread(self.server.wait_idle)

    async def checkpoint(self, t0: float) -> None:
        """Hold new calls, let the server go idle and give its heap back, sample, go on."""
        self.running.clear()
        try:
            await self.no_call.wait()
            idle = await asyncio.to_thread(self.server.wait_idle, 60.0)
            await asyncio.sleep(self.args.checkpoint_settle_s)  # the heap trim after the last call
            sample = await asyncio.to_thread(self.server.sample)
            self.checkpoints.append({
                "t": sample["t"], "soak_s": round(time.monotonic() - t0, 1),
                "session_hours": round(self.call_time_s / 3600.0, 4),
                "rss_mb": sample["rss_mb"], "tree_rss_mb": sample["tree_rss_mb"],
                "idle": not idle["sessions"], "heap_trims": sample.get("heap_trims"),
            })
            print(f"checkpoint at {self.checkpoints[-1]['soak_s']:.0f} s: server {sample['rss_mb']:.1f} MB, "
                  f"tree {sample['tree_rss_mb']:.1f} MB", flush=True)
        finally:
            self.running.set()

    async def checkpoints_every(self, period_s: float, stop_at: float, t0: float) -> None:
        await self.checkpoint(t0)  # the reference, right after the warm-up calls
        while time.monotonic() + period_s < stop_at:
            await asyncio.sleep(period_s)
            await self.checkpoint(t0)

    async def soak(self) -> None:
        t0 = time.monotonic()
        stop_at = t0 + 60.0 * self.args.minutes
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(stop))
        try:
            async with asyncio.TaskGroup() as tg:
                for i in range(self.args.sessions):
                    tg.create_task(self.caller(i, stop_at))
                if self.args.checkpoint_min > 0:
                    tg.create_task(self.checkpoints_every(60.0 * self.args.checkpoint_min, stop_at, t0))
        finally:
            stop.set()
            await sampler

    async def overload(self) -> dict[str, Any]:
        cap = int(self.server.health()["capacity"])
        cfg = replace(self.probe_config("native", self.args.overload_turns, False), stagger_s=0.05)
        alone = await run_level(cfg, cap)
        await asyncio.to_thread(self.server.wait_idle)
        both = await run_level(cfg, 2 * cap)
        await asyncio.to_thread(self.server.wait_idle)
        by_session: dict[int, list[TurnRecord]] = {}
        for r in both:
            by_session.setdefault(r.session, []).append(r)
        refused = {i: recs for i, recs in by_session.items() if any(e.startswith("connect:") for e in recs[0].errors)}
        admitted = [r for i, recs in by_session.items() if i not in refused for r in recs]
        reasons = sorted({e for recs in refused.values() for e in recs[0].errors})
        p95_alone = percentiles(r.voice_to_voice_ms for r in alone if r.status == "ok")["p95"]
        p95_admitted = percentiles(r.voice_to_voice_ms for r in admitted if r.status == "ok")["p95"]
        return {
            "capacity": cap,
            "alone": {"sessions": cap, "turns": len(alone), "ok": sum(r.status == "ok" for r in alone),
                      "v2v_ms": percentiles(r.voice_to_voice_ms for r in alone if r.status == "ok")},
            "overloaded": {
                "attempted": 2 * cap,
                "admitted": len(by_session) - len(refused),
                "refused": len(refused),
                "refused_clearly": all("capacity_exceeded" in e for e in reasons),
                "refusal_reasons": reasons[:5],
                "admitted_turns": len(admitted),
                "admitted_ok": sum(r.status == "ok" for r in admitted),
                "v2v_ms": percentiles(r.voice_to_voice_ms for r in admitted if r.status == "ok"),
            },
            "p95_ratio": None if not p95_alone or p95_admitted is None else round(p95_admitted / p95_alone, 3),
        }


def rss_trend(samples: list[dict[str, Any]], warmup_s: float, sessions: int) -> dict[str, Any]:
    """Least-squares slope of RSS after warm-up: MB per hour, and per session-hour."""
    if not samples:
        return {"n": 0}
    t0 = samples[0]["t"]
    rows = [(s["t"] - t0, s["tree_rss_mb"], s["rss_mb"]) for s in samples if s["t"] - t0 >= warmup_s]
    if len(rows) < 3:
        return {"n": len(rows), "note": "too few samples after warm-up for a fit"}
    t = np.array([r[0] for r in rows]) / 3600.0
    out: dict[str, Any] = {"n": len(rows), "span_s": round(3600 * (t[-1] - t[0]), 1)}
    for key, col in (("tree", 1), ("main", 2)):
        y = np.array([r[col] for r in rows])
        slope, _ = np.polyfit(t, y, 1)
        out[f"{key}_mb_per_hour"] = round(float(slope), 2)
        out[f"{key}_mb_per_session_hour"] = round(float(slope) / max(1, sessions), 2)
        out[f"{key}_first_mb"], out[f"{key}_last_mb"] = float(y[0]), float(y[-1])
    # The floor: the lowest sample of each minute, i.e. memory kept between replies. A fit
    # over every sample follows where the ~50 MB per-reply peaks happen to fall; the floor
    # is what a per-call leak raises.
    floors: dict[int, float] = {}
    for ts, tree, _ in rows:
        floors[int(ts // 60)] = min(floors.get(int(ts // 60), float("inf")), tree)
    if len(floors) >= 3:
        minutes = np.array(sorted(floors))
        slope, _ = np.polyfit(minutes / 60.0, np.array([floors[m] for m in minutes]), 1)
        out["floor_mb_per_hour"] = round(float(slope), 2)
        out["floor_mb_per_session_hour"] = round(float(slope) / max(1, sessions), 2)
        out["floor_first_mb"], out["floor_last_mb"] = floors[int(minutes[0])], floors[int(minutes[-1])]
    return out


def idle_trend(checkpoints: list[dict[str, Any]], warmup_h: float = 0.0) -> dict[str, Any]:
    """RSS at the idle checkpoints against the session-hours served before each: what a
    call leaves behind, without the in-flight buffers that make the floor noisy. The first
    checkpoint (after only the warm-up calls) is the reference; the slope is fitted from
    the second on, and from ``warmup_h`` session-hours on: native caches (CTranslate2's
    allocator, vLLM's) fill over the first ~0.4 session-hours, then stay."""
    out: dict[str, Any] = {"n": len(checkpoints), "warmup_h": warmup_h, "points": [
        (c["session_hours"], c["rss_mb"], c["tree_rss_mb"]) for c in checkpoints]}
    fit = [c for c in checkpoints[1:] if c["session_hours"] >= warmup_h]
    if len(fit) >= 3:
        x = np.array([c["session_hours"] for c in fit])
        for key, col in (("main", "rss_mb"), ("tree", "tree_rss_mb")):
            slope, _ = np.polyfit(x, np.array([c[col] for c in fit]), 1)
            out[f"{key}_mb_per_session_hour"] = round(float(slope), 2)
    return out


def idle_growth(before: dict[str, Any], warm: dict[str, Any], after: dict[str, Any], session_hours: float,
                calls: int) -> dict[str, Any]:
    """The idle RSS at the end against before the first call: everything the calls left,
    the warm-up's included (caches and arenas filling as much as any leak); ``warm``:
    the idle sample after the warm-up calls, to tell the first calls' share."""
    out: dict[str, Any] = {"session_hours": round(session_hours, 4), "calls": calls,
                           "heap_trims": after.get("heap_trims")}
    for key, col in (("main", "rss_mb"), ("tree", "tree_rss_mb")):
        grown = after[col] - before[col]
        out[f"{key}_before_mb"], out[f"{key}_after_mb"] = before[col], after[col]
        out[f"{key}_mb"] = round(grown, 2)
        out[f"{key}_warmup_mb"] = round(warm[col] - before[col], 2)
        out[f"{key}_mb_per_session_hour"] = round(grown / session_hours, 2) if session_hours else None
        out[f"{key}_kb_per_call"] = round(1024 * grown / calls, 1) if calls else None
    return out


def leaks(baseline: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
    fam_b, fam_f = baseline["task_families"], final["task_families"]
    grown = {k: fam_f.get(k, 0) - fam_b.get(k, 0) for k in set(fam_b) | set(fam_f)
             if fam_f.get(k, 0) != fam_b.get(k, 0)}
    return {
        "sessions": final["sessions"],
        "llm_unfinished": (final["llm_running"] or 0) + (final["llm_background_waiting"] or 0),
        "tasks": final["tasks"] - baseline["tasks"],
        "task_families_changed": grown,
        "fds": final["fds"] - baseline["fds"],
        "fd_kinds_changed": {
            k: final.get("fd_kinds", {}).get(k, 0) - baseline.get("fd_kinds", {}).get(k, 0)
            for k in set(baseline.get("fd_kinds", {})) | set(final.get("fd_kinds", {}))
            if final.get("fd_kinds", {}).get(k, 0) != baseline.get("fd_kinds", {}).get(k, 0)
        },
        "threads": final["threads"] - baseline["threads"],
    }


def targets(result: dict[str, Any], args: argparse.Namespace) -> dict[str, bool]:
    lk, trend = result["leaks"], result["rss_trend"]
    out = {
        "no_session_left": lk["sessions"] == 0,
        "no_vllm_request_left": lk["llm_unfinished"] == 0,
        "no_task_leaked": lk["tasks"] <= 0,
        "no_fd_leaked": lk["fds"] <= 0,
        "no_failed_call": result["calls"]["failed"] == 0,
        "no_traceback": result["server_log"]["tracebacks"] == 0,
    }
    idle = result.get("idle_trend") or {}
    if "tree_mb_per_session_hour" in idle:
        out["memory_flat"] = idle["tree_mb_per_session_hour"] < args.max_mb_per_session_hour
    elif "tree_mb_per_session_hour" in trend:
        slope = trend.get("floor_mb_per_session_hour", trend["tree_mb_per_session_hour"])
        out["memory_flat"] = slope < args.max_mb_per_session_hour
    ov = result.get("overload")
    if ov:
        o = ov["overloaded"]
        out["excess_refused_clearly"] = o["refused"] == o["attempted"] - ov["capacity"] and o["refused_clearly"]
        out["admitted_all_ok"] = o["admitted_ok"] == o["admitted_turns"]
        out["admitted_p95_within_10pct"] = ov["p95_ratio"] is not None and ov["p95_ratio"] <= 1.10
    return out


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'t_s':>6} {'rss_MB':>8} {'tree_MB':>8} {'fds':>5} {'thr':>4} {'tasks':>6} {'sess':>5} {'llm':>4}")
    t0 = result["samples"][0]["t"] if result["samples"] else 0
    for s in result["samples"]:
        print(f"{s['t'] - t0:6.0f} {s['rss_mb']:8.1f} {s['tree_rss_mb']:8.1f} {s['fds']:5d} {s['threads']:4d} "
              f"{s['tasks']:6d} {s['sessions']:5d} {(s['llm_running'] or 0) + (s['llm_background_waiting'] or 0):4d}")
    c, lk, tr, ig = result["calls"], result["leaks"], result["rss_trend"], result["idle_growth"]
    print(f"\ncalls: {c['placed']} placed, {c['completed']} completed, {c['dropped']} dropped abruptly, "
          f"{c['failed']} failed; {c['barge_turns']} barge-in turns; v2v p50/p95 "
          f"{result['v2v_ms']['p50']}/{result['v2v_ms']['p95']} ms over {result['v2v_ms']['n']} turns")
    print(f"leaks after the soak: sessions {lk['sessions']}, vLLM requests {lk['llm_unfinished']}, "
          f"tasks {lk['tasks']:+d}, fds {lk['fds']:+d} {lk['fd_kinds_changed'] or ''}, threads {lk['threads']:+d}")
    print(f"idle RSS from before the first call to {ig['session_hours']:.3f} session-hours later "
          f"({ig['calls']} calls, allocator {result['config']['allocator']}): server "
          f"{ig['main_before_mb']:.1f} -> {ig['main_after_mb']:.1f} MB ({ig['main_mb']:+.1f}, the warm-up calls "
          f"{ig['main_warmup_mb']:+.1f}), tree {ig['tree_before_mb']:.1f} -> {ig['tree_after_mb']:.1f} MB "
          f"({ig['tree_mb']:+.1f}, the warm-up calls {ig['tree_warmup_mb']:+.1f})")
    if "tree_mb_per_hour" in tr:
        print(f"RSS trend after warm-up ({tr['n']} samples, {tr['span_s']} s): tree "
              f"{tr['tree_mb_per_hour']:+.1f} MB/h = {tr['tree_mb_per_session_hour']:+.2f} MB/session-hour; "
              f"server process {tr['main_mb_per_hour']:+.1f} MB/h")
        if "floor_mb_per_hour" in tr:
            print(f"  floor (lowest sample per minute, what the target uses): {tr['floor_first_mb']:.1f} -> "
                  f"{tr['floor_last_mb']:.1f} MB, {tr['floor_mb_per_hour']:+.1f} MB/h = "
                  f"{tr['floor_mb_per_session_hour']:+.2f} MB/session-hour")
    it = result.get("idle_trend") or {}
    if it.get("n"):
        pts = ", ".join(f"{h:.2f} h: {m:.1f}" for h, m, _ in it["points"])
        print(f"idle checkpoints (session-hours: server MB): {pts}")
        if "tree_mb_per_session_hour" in it:
            print(f"  idle slope from the 2nd checkpoint and {it['warmup_h']} session-hours (what the target uses): server "
                  f"{it['main_mb_per_session_hour']:+.2f}, tree {it['tree_mb_per_session_hour']:+.2f} MB/session-hour")
    ov = result.get("overload")
    if ov:
        o = ov["overloaded"]
        print(f"overload: capacity {ov['capacity']}: {o['attempted']} attempted, {o['admitted']} admitted, "
              f"{o['refused']} refused ({'clearly' if o['refused_clearly'] else 'NOT clearly'}); admitted v2v p95 "
              f"{o['v2v_ms']['p95']} ms vs {ov['alone']['v2v_ms']['p95']} ms alone (x{ov['p95_ratio']})")
    log = result["server_log"]
    print(f"server log: {log['tracebacks']} tracebacks, {log['error_lines']} ERROR lines, "
          f"{log['loop_stalls']} event-loop stalls (server.loop_stall_s)")
    for line in log["loop_stall_lines"]:
        print(f"  {line}")
    if log["first_loop_stack"]:
        print(f"the first stall's stack:\n{log['first_loop_stack']}")
    heap = result.get("heap_growth")
    if heap and "top" in heap:
        print(f"python heap allocated since the mark and still alive: {heap['growth_kb']:.1f} KB; by site:")
        for row in heap["top"][:10]:
            print(f"  {row['kb']:+9.1f} KB {row['count']:+6d}  {' <- '.join(reversed(row['where'][-3:]))}")
    print("targets: " + ", ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in result["targets"].items()))


async def mark_heap(server: ServerProcess, after_s: float, frames: int) -> None:
    """Trace the server's Python allocations from ``after_s`` into the soak (past the
    warm-up of caches and allocator arenas); the final report lists what is still alive
    of them, by site."""
    await asyncio.sleep(after_s)
    await asyncio.to_thread(server.heap, frames)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    clips = tuple(load_clip(p, 16000) for p in args.audio)
    server = ServerProcess(config=args.config, overrides=(*SERVER_SET, *ALLOCATORS[args.allocator][0], *args.set),
                           log_path=Path(args.server_log), env=server_env(args.allocator))
    t_start = time.time()
    await asyncio.to_thread(server.start)
    try:
        soak = Soak(args, server, clips)
        await asyncio.sleep(args.settle_s)
        before = await asyncio.to_thread(server.sample)  # no call yet
        baseline = await soak.warm_up()
        heap_mark = asyncio.create_task(mark_heap(server, args.heap_mark_s, args.heap)) if args.heap else None
        await soak.soak()
        await asyncio.sleep(args.settle_s)
        final = await asyncio.to_thread(server.wait_idle, 60.0)
        await asyncio.sleep(args.settle_s)
        final = await asyncio.to_thread(server.sample)
        # Idle past a heap trim (server.heap_trim_interval_s) before the growth's last sample.
        await asyncio.sleep(max(0.0, args.end_settle_s - args.settle_s))
        idle_end = await asyncio.to_thread(server.sample)
        heap_growth = None
        if heap_mark is not None:
            heap_mark.cancel()
            try:
                heap_growth = await asyncio.to_thread(server.heap)
            except (TimeoutError, OSError) as exc:
                heap_growth = {"error": f"{type(exc).__name__}: {exc}"}
        overload = await soak.overload() if args.overload_turns > 0 else None
    finally:
        exit_code = await asyncio.to_thread(server.stop)
    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "wall_s": round(time.time() - t_start, 1),
        "calls": soak.calls,
        "failures": soak.failures[:20],
        "turns": {"total": len(soak.records), "ok": sum(r.status == "ok" for r in soak.records)},
        "v2v_ms": percentiles(r.voice_to_voice_ms for r in soak.records if r.status == "ok" and r.barge_in is None),
        "baseline": baseline,
        "final": final,
        "leaks": leaks(baseline, final),
        "before_first_call": before,
        "idle_end": idle_end,
        "idle_growth": idle_growth(before, baseline, idle_end, soak.call_time_s / 3600.0,
                                   len(args.protocols) + soak.calls["placed"]),
        "rss_trend": rss_trend(soak.samples, args.warmup_s, args.sessions),
        "checkpoints": soak.checkpoints,
        "idle_trend": idle_trend(soak.checkpoints, args.idle_warmup_h),
        "heap_growth": heap_growth,
        "overload": overload,
        "server_exit_code": exit_code,
        "server_log": server.log_problems(),
        "samples": soak.samples,
        "missed_samples": soak.missed_samples,
        "turn_log": soak.turns,
    }
    result["targets"] = targets(result, args)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("--config", default="configs/test.yaml", help="server config (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="server config override, after " + " ".join(SERVER_SET))
    p.add_argument("--allocator", choices=list(ALLOCATORS), default="server",
                   help="the server's allocator settings: its own (server), those and MALLOC_ARENA_MAX=2 in its "
                        "environment for vLLM's engine core too (server+env), or glibc's defaults (glibc) "
                        "(default: %(default)s)")
    p.add_argument("--sessions", type=int, default=2, help="concurrent callers (default: %(default)s)")
    p.add_argument("--minutes", type=float, default=2.0, help="soak length (default: %(default)s)")
    p.add_argument("--protocols", type=lambda s: s.split(","), default=["native", "realtime", "twilio"],
                   help="comma-separated, from " + ",".join(PROTOCOLS) + " (default: native,realtime,twilio)")
    p.add_argument("--audio", nargs="+", default=default_audio(), help="caller clips (default: short shared clips)")
    p.add_argument("--barge-prob", type=float, default=0.3, help="share of calls that barge in (default: %(default)s)")
    p.add_argument("--drop-prob", type=float, default=0.25, help="share of calls dropped abruptly (default: %(default)s)")
    p.add_argument("--turn-timeout-s", type=float, default=45.0)
    p.add_argument("--sample-s", type=float, default=5.0, help="sampling period (default: %(default)s)")
    p.add_argument("--warmup-s", type=float, default=30.0, help="soak time left out of the RSS fit (default: %(default)s)")
    p.add_argument("--settle-s", type=float, default=3.0, help="quiet time before the final sample")
    p.add_argument("--end-settle-s", type=float, default=40.0,
                   help="quiet time before the idle-growth sample: over server.heap_trim_interval_s (default: %(default)s)")
    p.add_argument("--overload-turns", type=int, default=2, help="turns per caller in the overload phase (0: skip)")
    p.add_argument("--checkpoint-min", type=float, default=0.0,
                   help="every this many minutes, let the server go idle and sample it (0: never)")
    p.add_argument("--checkpoint-settle-s", type=float, default=40.0,
                   help="idle time before a checkpoint's sample: over server.heap_trim_interval_s (default: %(default)s)")
    p.add_argument("--idle-warmup-h", type=float, default=0.0,
                   help="session-hours left out of the idle-checkpoint fit (default: %(default)s)")
    p.add_argument("--max-mb-per-session-hour", type=float, default=1.0, help="memory target (default: %(default)s)")
    p.add_argument("--heap", type=int, default=0, metavar="FRAMES",
                   help="trace the server's Python heap (tracemalloc, FRAMES deep) and report what grew (0: off)")
    p.add_argument("--heap-mark-s", type=float, default=180.0, help="soak time before the heap baseline (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="artifacts/soak.json", help="report path (default: %(default)s)")
    p.add_argument("--server-log", default="artifacts/soak-server.log")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [p for p in args.protocols if p not in PROTOCOLS]
    if bad or not args.audio:
        print(f"soak: unknown protocols {bad}" if bad else "soak: no --audio clips found", file=sys.stderr)
        return 2
    result = asyncio.run(run(args))
    write_result(args.json, "soak", args, result)
    print_table(result)
    print(f"\nJSON: {args.json}; server log: {args.server_log}")
    return 1 if args.strict and not all(result["targets"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
