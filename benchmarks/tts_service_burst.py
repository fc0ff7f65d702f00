"""The TTS service in a burst of replies, on a CPU: its event loop and Kokoro's forward
threads share one GIL, and how long a forward's host calls take depends on the
interpreter's switch interval.

    python benchmarks/tts_service_burst.py --replies 256 --switch-ms 5 1 0.5 0.2 --json OUT.json

Every torch call releases the GIL and takes it back. While another thread of the process
runs Python, taking it back waits until that thread lets go, which it is made to do only
after the switch interval (``sys.setswitchinterval``, 5 ms by default). This measures
whether the service's own loop, in a burst, is such a thread: on a GPU, Kokoro's encode in a
burst has taken far longer than its launches cost alone (docs/gpu-results.md).

The service here is the real one (``TtsService`` over ``KokoroTts`` and ``KokoroBatcher``,
espeak G2P, ``tts.max_batch`` 64, ``tts.max_batch_s`` 32, two forward slots) in a process
of its own (``serve`` below), with Kokoro's torch runner replaced by a stand-in that makes a
forward's host calls (``--ops`` small torch ops, timed as the ``encode`` phase) and then
sleeps for the GPU's time (``--gpu-ms``, the GIL released, as a sync does) before it
delivers silence of each clause's length. The driver, another process, opens
``--connections`` WebSockets as the frontends do and sends every reply's three clauses at
once ("Sure,", then two sentences, each with the seconds of the reply ahead of it), reads
and acknowledges the audio, and asks the service for its figures after each burst. A
fresh service runs each switch interval; ``--bursts`` bursts each, the first one unmeasured.

Per switch interval: the stand-in's ``encode`` p95 (its host calls, ms), the forward p95,
the service's first audio p50/p95 and late later clauses (``tts_service.ClauseTimes``), the
clients' first audio per clause and the service process's CPU seconds per burst.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_util import JSON_EPILOG, summarise_ms, write_result  # benchmarks/, beside this file

HERE_FILE = str(Path(__file__).resolve())
ROOT = Path(HERE_FILE).parent.parent
CLAUSES = ("Sure,", "I can help with that.",
           "Your order shipped this morning and it should arrive on Thursday before noon.")


# ============================================================== the service (a process of its own)


def standin_runner(ops: int, gpu_s: float) -> Any:
    """A forward's host side without a GPU: ``ops`` torch calls, then the GPU's time asleep."""
    import numpy as np
    import torch

    from voicebot.engines.tts.kokoro_model import SAMPLES_PER_FRAME

    def run(batch: list[Any], deliver: Any) -> dict[str, float]:
        x = torch.zeros(8)
        t0 = time.perf_counter()
        for _ in range(ops):
            x.add_(1.0)  # one kernel launch's worth of host work: releases and retakes the GIL
        encode = time.perf_counter() - t0
        t1 = time.perf_counter()
        time.sleep(gpu_s)
        deliver(batch, [np.zeros(c.frames * SAMPLES_PER_FRAME, dtype=np.float32) for c in batch])
        return {"encode": encode, "sync": time.perf_counter() - t1}

    return run


async def serve(args: argparse.Namespace) -> None:
    from voicebot.config import TtsConfig
    from voicebot.engines.tts import kokoro_model as km
    from voicebot.engines.tts.kokoro import EspeakG2P, KokoroTts, RandomVoices
    from voicebot.services.tts_service import TtsService, listen

    # The GPU suite's TTS service: 64 clauses a forward at most, two forwards at once.
    cfg = TtsConfig(engine="kokoro", kokoro_model="random", voice="af_heart", workers=2, max_batch=64,
                    queue_size=4096)
    engine = KokoroTts(cfg, runner=standin_runner(args.ops, args.gpu_ms / 1000),
                       g2p=EspeakG2P(km.random_config()["vocab"]), voices=RandomVoices())
    await engine.start()
    service = TtsService(engine, engine_name="kokoro-standin")
    async with listen(service, "127.0.0.1", 0) as server:
        host, port = next(iter(server.sockets)).getsockname()[:2]
        print(json.dumps({"url": f"ws://{host}:{port}"}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the driver closes it
    await service.aclose()
    await engine.aclose()


# ============================================================== the driver


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_level(args: argparse.Namespace, switch_ms: float) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, HERE_FILE, "serve", "--switch-ms", str(switch_ms), "--ops", str(args.ops),
        "--gpu-ms", str(args.gpu_ms), stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        url = json.loads(await proc.stdout.readline())["url"]
        rows = []
        late_before = 0
        for b in range(args.bursts):
            c0, t0 = cpu_s(proc.pid), time.perf_counter()
            got = await burst_with_stats(url, args.replies, args.connections)
            s = got["stats"]
            # The service counts late clauses for its life: this burst's are the difference.
            s["late"], late_before = s["late"] - late_before, s["late"]
            row = {"burst": b, "wall_s": round(time.perf_counter() - t0, 2),
                   "service_cpu_s": round(cpu_s(proc.pid) - c0, 2), **got}
            print(f"[tts_service_burst] switch {switch_ms} ms burst {b}: encode p50/p95 "
                  f"{s.get('encode_ms_p50')}/{s.get('encode_ms_p95')} ms, forward p95 {s.get('forward_ms_p95')} "
                  f"(rows {s.get('forward_rows_mean')}), first audio p50/p95 {s.get('first_audio_ms_p50')}/"
                  f"{s.get('first_audio_ms_p95')}, late {s.get('late')}, service CPU {row['service_cpu_s']} s, "
                  f"wall {row['wall_s']} s", flush=True)
            rows.append(row)
        return {"switch_ms": switch_ms, "bursts": rows}
    finally:
        proc.stdin.close()  # the service's end
        try:
            async with asyncio.timeout(30):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def burst_with_stats(url: str, replies: int, connections: int) -> dict[str, Any]:
    """A burst, then the service's figures (asked on a connection of their own)."""
    import websockets

    got = await burst(url, replies, connections)
    async with websockets.connect(url, max_size=None, compression=None) as ws:
        json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "stats"}))
        got["stats"] = json.loads(await ws.recv())
    return got


async def burst(url: str, replies: int, connections: int) -> dict[str, Any]:
    """Every reply's clauses at once; per clause position the time to its first audio (ms)."""
    import websockets

    from voicebot.services.wire import split_frame

    socks = [await websockets.connect(url, max_size=None, compression=None) for _ in range(connections)]
    for ws in socks:
        json.loads(await ws.recv())  # hello
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    left = replies * len(CLAUSES)
    finished = asyncio.Event()
    ahead = (0.0, 0.3, 1.68)  # seconds of the reply before each clause (the H200 runs' reply)

    async def read(ws: Any) -> None:
        nonlocal left
        async for msg in ws:
            if isinstance(msg, bytes):
                head, _ = split_frame(msg, "audio")
                first.setdefault(head["id"], time.perf_counter())
                await ws.send(json.dumps({"type": "ack", "id": head["id"]}))
                continue
            data = json.loads(msg)
            if data.get("type") == "error":
                print(f"[tts_service_burst] clause {data.get('id')}: {data.get('code')} {data.get('message')}",
                      flush=True)
            if data.get("type") in ("done", "error"):
                left -= 1
                if left == 0:
                    finished.set()

    readers = [asyncio.create_task(read(ws)) for ws in socks]
    try:
        for r in range(replies):
            ws = socks[r % connections]
            for c, text in enumerate(CLAUSES):
                sent[r * 8 + c] = time.perf_counter()
                await ws.send(json.dumps({"type": "synthesize", "id": r * 8 + c, "text": text, "voice": "af_heart",
                                          "window": 4, "ahead_s": ahead[c]}))
        async with asyncio.timeout(300):
            await finished.wait()
    finally:
        for t in readers:
            t.cancel()
        for ws in socks:
            await ws.close()
    waits = {c: [1000 * (first[i] - sent[i]) for i in sent if i % 8 == c and i in first] for c in range(len(CLAUSES))}
    return {"first_audio_ms": {f"clause_{c + 1}": summarise_ms(w) for c, w in waits.items()}}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    levels = []
    for sw in args.switch_ms:
        levels.append(await run_level(args, sw))
        write_result(args.json, "tts_service_burst", args, {"levels": levels})
    print(f"{'switch ms':>9} {'encode p50':>10} {'encode p95':>10} {'forward p95':>11} {'first p95':>9} "
          f"{'late':>5} {'CPU s':>6}")
    for lv in levels:
        for row in lv["bursts"][1:] or lv["bursts"]:
            s = row["stats"]
            print(f"{lv['switch_ms']:>9} {s.get('encode_ms_p50', '-'):>10} {s.get('encode_ms_p95', '-'):>10} "
                  f"{s.get('forward_ms_p95', '-'):>11} {s.get('first_audio_ms_p95', '-'):>9} {s.get('late', '-'):>5} "
                  f"{row['service_cpu_s']:>6}")
    return {"levels": levels}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=JSON_EPILOG)
    sub = p.add_subparsers(dest="mode")
    s = sub.add_parser("serve", help="(internal) the service, with its switch interval")
    for q in (p, s):
        q.add_argument("--ops", type=int, default=50, help="torch calls a forward makes on the host (graphs: ~50)")
        q.add_argument("--gpu-ms", type=float, default=30.0, help="a forward's GPU time, slept with the GIL released")
    s.add_argument("--switch-ms", type=float, required=True)
    p.add_argument("--switch-ms", type=float, nargs="+", default=[5.0, 1.0, 0.5, 0.2])
    p.add_argument("--replies", type=int, default=256)
    p.add_argument("--connections", type=int, default=7, help="WebSockets, as the frontends open")
    p.add_argument("--bursts", type=int, default=3, help="per switch interval; the first is a warm-up")
    p.add_argument("--json", default=None)
    return p


if __name__ == "__main__":
    ns = build_parser().parse_args()
    sys.path.insert(0, str(ROOT))
    if ns.mode == "serve":
        sys.setswitchinterval(ns.switch_ms / 1000)
        asyncio.run(serve(ns))
    else:
        asyncio.run(main(ns))
