"""What the probe itself costs at N sessions, against a trivial local server.

    python benchmarks/pipeline_probe_cost.py --sessions 64 256 512 --workers 0 \
        --audio ../shared/audio/librivox_08*.wav --json artifacts/probe_cost.json

The server (``--server-procs`` processes sharing the port, SO_REUSEPORT) speaks the
native protocol and does almost nothing: it finds the caller's end of speech with the
probe's own -40 dBFS rule, waits ``--reply-delay-ms`` after it, then streams a
``--reply-s`` tone in 20 ms chunks at real-time pace and reports its own view of the
delay in ``turn.timings.voice_to_voice_ms`` (first reply chunk handed to the socket
minus arrival of the last loud frame). So per turn

    timing error = what the probe measured - what the server measured

is the probe's own error (its loop lag on both ends of the measurement, plus loopback
and the server's receive lag, which is small with few sessions per server process).
CPU per session is the probe processes' CPU over the level, divided by sessions and
wall time. Nothing here is asserted: it prints a table and writes JSON.

``--probe-src DIR`` runs another copy of the probe (e.g. ``git archive HEAD~1 voicebot
| tar -x -C DIR``) to compare implementations; one without ``run_level_measured`` runs
in this process and its CPU is this process's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from bench_util import JSON_EPILOG, write_result  # benchmarks/, beside this file

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_AUDIO = ("goforward.wav", "librivox_0880.wav", "librivox_0930.wav")


# ------------------------------------------------------------------ trivial server
def _server_main(port: int, reply_delay_s: float, reply_s: float, quiet_s: float, ready: Any) -> None:
    import numpy as np
    from websockets.asyncio.server import ServerConnection, serve

    out_rate = 24_000
    chunk = out_rate // 50  # 20 ms
    t = np.arange(int(reply_s * out_rate)) / out_rate
    tone = (0.3 * 32767 * np.sin(2 * np.pi * 440 * t)).astype("<i2").tobytes()
    chunks = [tone[i : i + 2 * chunk] for i in range(0, len(tone), 2 * chunk)]
    # Same rule as the probe: a 10 ms block above -40 dBFS (energy, PCM16 units).
    def loud(frame: bytes, rate: int) -> bool:
        x = np.frombuffer(frame, "<i2").astype(np.float64)
        n = rate // 100
        blocks = x[: x.size // n * n].reshape(-1, n)
        return bool(np.any(np.einsum("ij,ij->i", blocks, blocks) > n * (32768 * 0.01) ** 2))

    async def reply(ws: ServerConnection, rid: str, last_loud: float) -> None:
        await asyncio.sleep(max(0.0, last_loud + reply_delay_s - time.monotonic()))
        await ws.send(json.dumps({"type": "response.started", "response_id": rid, "item_id": "i"}))
        await ws.send(json.dumps({"type": "response.audio.started", "response_id": rid, "item_id": "i"}))
        t0 = time.monotonic()
        first = None
        for k, c in enumerate(chunks):
            delay = t0 + 0.02 * k - 0.12 - time.monotonic()  # 120 ms ahead, like the playout
            if delay > 0:
                await asyncio.sleep(delay)
            await ws.send(c)
            first = first or time.monotonic()
        done = {"type": "response.done", "response_id": rid, "item_id": "i", "status": "completed",
                "text": "ok", "full_text": "ok"}
        await ws.send(json.dumps(done))
        v2v = 1000.0 * ((first or t0) - last_loud)
        await ws.send(json.dumps({"type": "turn.timings", "response_id": rid, "voice_to_voice_ms": round(v2v, 2)}))

    async def handler(ws: ServerConnection) -> None:
        start = json.loads(await ws.recv())
        rate = int(start["sample_rate"])
        await ws.send(json.dumps({"type": "session.started", "session_id": "s", "sample_rate": rate,
                                  "output_sample_rate": out_rate}))
        last_loud: float | None = None
        turn = 0
        replying: asyncio.Task[None] | None = None
        try:
            async for msg in ws:
                if not isinstance(msg, bytes):
                    continue
                now = time.monotonic()
                if loud(msg, rate):
                    last_loud = now
                elif last_loud is not None and now - last_loud >= quiet_s and (replying is None or replying.done()):
                    replying = asyncio.create_task(reply(ws, f"r{turn}", last_loud))
                    turn += 1
                    last_loud = None
        finally:
            if replying is not None:
                replying.cancel()

    async def main() -> None:
        async with serve(handler, "127.0.0.1", port, reuse_port=True, max_size=1 << 20, compression=None):
            ready.set()
            await asyncio.Future()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


# ------------------------------------------------------------------ driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run_level(cfg: Any, n: int, workers: int) -> tuple[list[Any], dict[str, Any]]:
    from dataclasses import replace

    import voicebot.probe.client as client

    if hasattr(client, "run_level_measured"):
        result = await client.run_level_measured(replace(cfg, workers=workers), n)
        return result.records, result.stats.as_dict()
    cpu0, t0 = time.process_time(), time.monotonic()  # an older probe: in this process
    records = await client.run_level(cfg, n)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    return records, {"workers": 1, "sessions": n, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                     "cores": round(cpu / wall, 3), "cpu_per_session_pct": round(100 * cpu / wall / n, 3)}


def summarize(records: list[Any]) -> dict[str, Any]:
    from voicebot.probe.measure import percentiles

    errs = [r.voice_to_voice_ms - r.timings["voice_to_voice_ms"] for r in records
            if r.status == "ok" and r.voice_to_voice_ms is not None and "voice_to_voice_ms" in r.timings]
    return {
        "turns": len(records),
        "ok": sum(r.status == "ok" for r in records),
        "v2v_ms": percentiles(r.voice_to_voice_ms for r in records if r.status == "ok"),
        "timing_error_ms": percentiles(errs),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("--sessions", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--workers", type=int, default=0, help="probe processes; 0: the probe's auto rule")
    p.add_argument("--server-procs", type=int, default=2)
    p.add_argument("--audio", nargs="+", help="clips (default: three of ../shared/audio)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--ramp-s", type=float, default=5.0, help="session starts spread over this long")
    p.add_argument("--reply-delay-ms", type=float, default=500.0)
    p.add_argument("--reply-s", type=float, default=2.0)
    p.add_argument("--probe-src", type=Path, help="import the probe from this copy instead")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.probe_src:
        sys.path.insert(0, str(args.probe_src.resolve()))
    else:
        sys.path.insert(0, str(ROOT))
    from voicebot.probe.client import ProbeConfig
    from voicebot.probe.clips import load_clip

    audio = args.audio or [str(ROOT.parent / "shared" / "audio" / a) for a in DEFAULT_AUDIO]
    clips = tuple(load_clip(a, 16000) for a in audio)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    servers = []
    for _ in range(args.server_procs):
        ready = ctx.Event()
        proc = ctx.Process(target=_server_main, args=(port, args.reply_delay_ms / 1000, args.reply_s, 0.3, ready),
                           daemon=True)
        proc.start()
        if not ready.wait(30):
            raise SystemExit("trivial server did not start")
        servers.append(proc)
    out: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "cpus": os.cpu_count(), "probe_src": str(args.probe_src or ROOT), "levels": []}
    try:
        for n in args.sessions:
            from voicebot.probe import cli as probe_cli

            workers = args.workers
            if workers == 0:
                workers = probe_cli.auto_workers(n) if hasattr(probe_cli, "auto_workers") else 1
            cfg = ProbeConfig(url=f"ws://127.0.0.1:{port}/ws", clips=clips, turns=args.turns, gap_s=0.5,
                              timeout_s=30.0, stagger_s=args.ramp_s / n)
            records, cost = asyncio.run(run_level(cfg, n, workers))
            level = {"sessions": n, **summarize(records), "probe": cost}
            out["levels"].append(level)
            e, v = level["timing_error_ms"], level["v2v_ms"]
            print(f"N={n:4d} workers={cost['workers']:2d} ok {level['ok']}/{level['turns']}  "
                  f"v2v p50 {v['p50']} p95 {v['p95']}  error p50 {e['p50']} p95 {e['p95']} p99 {e['p99']} ms  "
                  f"probe {cost['cores']} cores = {cost['cpu_per_session_pct']}% core/session", flush=True)
    finally:
        for proc in servers:
            proc.terminate()
        for proc in servers:
            proc.join(5)
            with contextlib.suppress(Exception):
                proc.kill()
    write_result(args.json, "pipeline_probe_cost", args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
