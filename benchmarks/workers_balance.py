"""How evenly a server of several workers on one port (``server.workers``) spreads calls:
N native calls opened at once, then N one after the other, and each worker's open calls
read from ``/healthz`` (its ``workers`` list) while they are all up.

    voicebot serve --config configs/test.yaml --port 8310 --workers 3 \\
        --set llm.backend=remote --set llm.remote.url=http://127.0.0.1:8000 --set server.max_sessions=64
    python benchmarks/workers_balance.py --url ws://127.0.0.1:8310/ws --calls 30 45 60 --json OUT/balance.json

The calls only open (``session.start``) and close: what is measured is where they land.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from typing import Any

from bench_util import JSON_EPILOG, write_result  # benchmarks/, beside this file

from voicebot.probe.base import ConnectOptions
from voicebot.probe.native import NativeClient


def per_worker(http: str, key: str | None) -> list[int]:
    request = urllib.request.Request(f"{http}/healthz", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as resp:
        body = json.loads(resp.read())
    if "workers" not in body:
        raise SystemExit("/healthz lists no workers: is the server running with server.workers > 1 (and --key given)?")
    return [int(w["active_sessions"]) for w in body["workers"]]


async def level(url: str, http: str, n: int, at_once: bool, key: str | None) -> list[int]:
    clients = [NativeClient(ConnectOptions(url, 16000, 16000, token=key)) for _ in range(n)]
    try:
        if at_once:
            await asyncio.gather(*(c.connect() for c in clients))
        else:
            for c in clients:
                await c.connect()
        return per_worker(http, key)
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        await asyncio.sleep(2.0)  # the calls' ends reach every worker before the next level


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, epilog=JSON_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server's native WebSocket URL (ws://HOST:PORT/ws)")
    p.add_argument("--calls", type=int, nargs="+", default=[30, 45, 60])
    p.add_argument("--key", help="an API key, when the server has them (it also shows /healthz's workers)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    http = args.url.replace("ws://", "http://").replace("wss://", "https://").rsplit("/ws", 1)[0]
    rows: list[dict[str, Any]] = []
    for n in args.calls:
        for mode in ("at_once", "one_by_one"):
            counts = asyncio.run(level(args.url, http, n, mode == "at_once", args.key))
            rows.append({"calls": n, "mode": mode, "per_worker": counts, "spread": max(counts) - min(counts)})
            print(f"{n:4d} calls {mode:10s} per worker {counts}  (most - least: {max(counts) - min(counts)})", flush=True)
    write_result(args.json, "workers_balance", args, {"levels": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
