"""What one caller costs the frontend's event loop, per second of call.

On the GPU machine a frontend's loop thread was the first CPU limit: 0.62 cores at 32
callers, 0.77 at 48 (docs/gpu-results.md), i.e. ~20 ms of one core per caller-second.
At 500 callers on 16 cores that alone would take 10 of them. Most of it is per audio
frame, not per turn: 50 frames a second come in (WebSocket, PCM decode, resampling,
Silero VAD, turn logic) whatever the caller says. This script measures that part on
any machine, with the real server:

    python benchmarks/loop_cost.py --config configs/default.yaml --sessions 8 16 32 \
        --seconds 20 --out artifacts/loop_cost.json [--py-spy]

It starts ``voicebot serve`` (the real CLI path, through benchmarks/serverproc.py), opens N native ``/ws`` calls that
stream 20 ms frames of silence in real time (a phone line is never quiet on the wire),
and reads the server's main thread (the event loop) CPU time from /proc over a window
after all calls are up. Silence keeps the engines idle, so what is measured is the
loop's own per-frame work. ``--py-spy`` also records where the loop spends it (py-spy
must be on PATH: ``pip install py-spy``) and prints the top functions by own time.

Output: per level, loop cores, cores per caller, ms of loop per caller-second and per
inbound frame, the whole process's cores; JSON with the same.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import JSON_EPILOG, write_result  # noqa: E402
from serverproc import ServerProcess  # noqa: E402  (benchmarks/, beside this file)

from voicebot.probe.base import ClientClosed, ConnectOptions  # noqa: E402
from voicebot.probe.native import NativeClient  # noqa: E402

FRAME_MS = 20
RATE = 16000
TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int, tid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def caller(url: str, stop: asyncio.Event, frames: collections.Counter[str]) -> None:
    client = NativeClient(ConnectOptions(url, RATE, 16000))
    await client.connect()
    silence = bytes(2 * RATE * FRAME_MS // 1000)

    async def drain() -> None:
        try:
            while True:
                await client.receive()
        except ClientClosed:
            pass

    reader = asyncio.create_task(drain())
    start = time.monotonic()
    i = 0
    try:
        while not stop.is_set():
            await client.send_audio(silence)
            frames["sent"] += 1
            i += 1
            await asyncio.sleep(max(0.0, start + i * FRAME_MS / 1000 - time.monotonic()))
    finally:
        reader.cancel()
        await client.close()


async def level(url: str, pid: int, n: int, seconds: float, spy: Path | None) -> dict[str, Any]:
    stop = asyncio.Event()
    frames: collections.Counter[str] = collections.Counter()
    tasks = [asyncio.create_task(caller(url, stop, frames)) for _ in range(n)]
    await asyncio.sleep(3.0)  # every call up and streaming
    for t in tasks:
        if t.done():
            t.result()  # a refused call is an error here, not a lower figure
    spy_proc = None
    if spy is not None:
        spy_proc = await asyncio.create_subprocess_exec(
            "py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "100",
            "--format", "raw", "-o", str(spy), "--nonblocking",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
    loop0, proc0, f0, t0 = thread_cpu_s(pid, pid), process_cpu_s(pid), frames["sent"], time.monotonic()
    await asyncio.sleep(seconds)
    loop1, proc1, f1, t1 = thread_cpu_s(pid, pid), process_cpu_s(pid), frames["sent"], time.monotonic()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    if spy_proc is not None:
        await asyncio.wait_for(spy_proc.wait(), 60)
    wall = t1 - t0
    loop_cores = (loop1 - loop0) / wall
    frames_per_s = (f1 - f0) / wall
    row = {
        "sessions": n,
        "seconds": round(wall, 1),
        "loop_cores": round(loop_cores, 3),
        "process_cores": round((proc1 - proc0) / wall, 3),
        "loop_ms_per_caller_s": round(1000 * loop_cores / n, 2),
        "loop_us_per_frame_in": round(1e6 * loop_cores / frames_per_s, 1) if frames_per_s else None,
        "frames_in_per_s": round(frames_per_s, 1),
    }
    return row


def top_functions(raw: Path, n: int = 12) -> dict[str, list[tuple[str, float]]]:
    """Shares of the sampled time (py-spy leaves out idle waits): by own time (the
    leaf of each stack; native code such as uvloop's shows as its Python caller) and,
    for our own functions, inclusive."""
    own: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = [f.rsplit(":", 1)[0] + ")" if f.endswith(")") else f for f in stack.split(";")]  # no line numbers
        own[frames[-1]] += int(count)
        for frame in {f.split(" (", 1)[0] for f in frames if "(voicebot/" in f}:
            ours[frame] += int(count)
        total += int(count)
    if not total:
        return {"own": [], "ours_inclusive": []}

    def share(c: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * k / total, 1)) for name, k in c.most_common(n)]

    return {"own": share(own), "ours_inclusive": share(ours)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for the server")
    ap.add_argument("--sessions", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--py-spy", action="store_true", help="record the loop with py-spy (on PATH)")
    ap.add_argument("--json", "--out", dest="out", type=Path, default=Path("artifacts/loop_cost.json"))
    args = ap.parse_args()
    if args.py_spy and shutil.which("py-spy") is None:
        raise SystemExit("--py-spy: py-spy is not on PATH (pip install py-spy)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.config, ("server.max_sessions=1000", *args.set), log_path=args.out.with_suffix(".server.log"))
    server.start(timeout_s=600)
    assert server.proc is not None
    rows = []
    try:
        for n in args.sessions:
            spy = args.out.with_name(f"{args.out.stem}_spy_{n}.txt") if args.py_spy else None
            row = asyncio.run(level(server.ws + "/ws", server.proc.pid, n, args.seconds, spy))
            if spy is not None and spy.exists():
                row["py_spy"], row["top_self"] = str(spy), top_functions(spy)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top_self"}), flush=True)
            for kind, top in row.get("top_self", {}).items():
                print(f"  {kind}:")
                for name, pct in top:
                    print(f"    {pct:5.1f}%  {name}")
            time.sleep(2.0)  # the calls' teardown
    finally:
        server.stop()
    write_result(args.out, "loop_cost", args, {"levels": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
