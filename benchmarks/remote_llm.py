"""The remote LLM tier: what the HTTP hop costs, and what session affinity buys.

    python benchmarks/remote_llm.py hop --json artifacts/remote_llm_hop.json        # CPU, this machine
    python benchmarks/remote_llm.py gpu --model-dir DIR --json OUT                  # 2 GPUs

``hop`` (any machine, the CPU default config): the same model, the same prompts, on
the same machine, three ways, one after another (never at once: they share cores):

  inprocess   the frontend's own vLLM (``LlmEngine``, llm.backend inprocess)
  direct      ``RemoteLlmEngine`` -> one ``vllm serve`` (the HTTP hop)
  router      ``RemoteLlmEngine`` -> vllm-router -> the same server (hop + router)

  LLM stage: ``--sessions`` conversations of ``--turns`` turns each, one request at
  a time; TTFT is measured from the call of ``generate`` to the first token, as the
  session sees it (``GenerationStats``), with cached prompt tokens per turn.
  Voice to voice (``--v2v-turns``, 0 to skip): a real frontend (whisper, TTS) with
  the in-process LLM, then with the router tier; a caller speaks real clips and the
  server's ``turn.timings`` give voice_to_voice_ms and llm_ttft_ms per turn.

``gpu`` (a machine with 2 GPUs and vLLM; vllm-router installed from its PyPI wheel):
voice-shaped LLM load (``--sessions`` conversations sharing a ``--system-tokens``
system prompt, ``--user-tokens`` utterances, ``--reply-tokens`` replies, ``--think-s``
pauses) for ``--duration-s`` against

  one          one server (GPU 0), direct
  two-affinity two servers behind vllm-router, sticky_least_loaded (X-Session-ID)
  two-round    two servers behind vllm-router, round_robin (no affinity)

and reports TTFT p50/p95 and the prefix-cache hit rate (cached / prompt tokens, from
each reply's usage block) side by side. ``load_format dummy`` (a config.json of the
real model's shape): speed does not depend on the weights.

JSON goes to ``--json`` (rewritten after each part); a table is printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STARTED = time.monotonic()
ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_util import JSON_EPILOG, cpu_busy_total, summarise_ms, write_result  # noqa: E402
from llm_load import load_engine_module  # noqa: E402  (same folder)
from llm_tier import llm_tier  # noqa: E402  (tests/llm_tier.py: starts and stops the tier)

from voicebot.affinity import bind_session  # noqa: E402
from voicebot.config import load_config  # noqa: E402
from voicebot.session.history import Conversation  # noqa: E402

_llm = load_engine_module("llm")
_remote = load_engine_module("llm_remote")
LlmEngine, Lane, GenerationStats = _llm.LlmEngine, _llm.Lane, _llm.GenerationStats
RemoteLlmEngine = _remote.RemoteLlmEngine

SYSTEM = (
    "You are Ava, the voice assistant of Northline Rail. Answer in one or two short spoken "
    "sentences; never use lists or markdown. You help with timetables, delays, tickets, refunds, "
    "bicycles on trains and assistance for travellers with reduced mobility. "
)
UTTERANCES = [
    "When does the next train to the airport leave?",
    "Can I bring my bike on the eight fifteen service?",
    "My train was cancelled yesterday, what can I claim back?",
    "Is there a lift at the central station?",
    "How much is a return to the city with a railcard?",
    "I left my bag on the seven forty from the harbour, where do I ask?",
    "Is the coast line open again after the storm?",
    "What is the quickest way to the university on Sunday?",
]


def write(path: str | None, report: dict[str, Any], benchmark: str = "remote_llm",
          args: argparse.Namespace | None = None) -> None:
    write_result(path, benchmark, args, report)


def saver(args: argparse.Namespace, report: dict[str, Any], side: str) -> Callable[[dict[str, Any]], None]:
    def save(summary: dict[str, Any]) -> None:
        report["voice_to_voice"][side] = summary
        write(args.json, report, args=args)
    return save


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": str(os.cpu_count())}
    for mod in ("vllm", "aiohttp", "torch"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        out["vllm-router"] = version("vllm-router")
    return out


# ------------------------------------------------------------------ LLM stage
async def conversations(engine: Any, tok: Any, *, sessions: int, turns: int, reply_tokens: int,
                        system: str, seed: int = 0, concurrent: bool = False, think_s: tuple[float, float] = (0.0, 0.0),
                        until: float | None = None, min_tokens: int = 0) -> list[dict[str, Any]]:
    """Drive ``sessions`` conversations through ``engine``; one record per turn."""
    records: list[dict[str, Any]] = []

    async def one(s: int) -> None:
        bind_session(f"sess_bench{seed}_{s:04d}")  # what a call's session does (voicebot/affinity.py)
        rng = random.Random(seed * 1000 + s)
        conv = Conversation(tok, f"{system} (Caller {s}.)" if concurrent else system, 100_000, reply_tokens)
        if concurrent:
            await asyncio.sleep(rng.uniform(0.0, think_s[1]))
        t = 0
        while (t < turns) if until is None else (time.monotonic() < until):
            user = UTTERANCES[rng.randrange(len(UTTERANCES))]
            prompt = conv.prompt_ids(user)
            st = GenerationStats(request_id="", lane=Lane.INTERACTIVE)
            parts, ids = [], []
            t0 = time.monotonic()
            try:
                async for d in engine.generate(prompt, max_tokens=reply_tokens, min_tokens=min_tokens,
                                               temperature=0.0, stats=st):
                    parts.append(d.text)
                    ids.extend(d.token_ids)
            except Exception as exc:  # a failed turn is a data point, not the end of the run
                records.append({"session": s, "turn": t, "error": f"{type(exc).__name__}: {exc}"})
                t += 1
                continue
            records.append({
                "session": s, "turn": t, "ttft_ms": None if st.ttft_s is None else 1000 * st.ttft_s,
                "total_ms": 1000 * (time.monotonic() - t0), "prompt_tokens": st.prompt_tokens,
                "cached_tokens": st.cached_tokens, "output_tokens": st.output_tokens,
            })
            conv.append("user", user)
            conv.append("assistant", "".join(parts), token_ids=ids)
            t += 1
            if think_s[1] > 0:
                await asyncio.sleep(rng.uniform(*think_s))

    if concurrent:
        await asyncio.gather(*(asyncio.create_task(one(s)) for s in range(sessions)))
    else:
        for s in range(sessions):
            await asyncio.create_task(one(s))  # its own task: its own session binding
    return records


def stage_summary(records: list[dict[str, Any]], skip_first: bool = True) -> dict[str, Any]:
    ok = [r for r in records if "error" not in r]
    # The first turn of the first conversation pays for warm-up on every backend alike.
    timed = [r for r in ok if not (skip_first and r["session"] == 0 and r["turn"] == 0)]
    later = [r for r in timed if r["turn"] > 0]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "turns": len(records), "errors": len(records) - len(ok),
        "ttft_ms": summarise_ms([r["ttft_ms"] for r in timed if r["ttft_ms"] is not None]),
        "ttft_later_turns_ms": summarise_ms([r["ttft_ms"] for r in later if r["ttft_ms"] is not None]),
        "total_ms": summarise_ms([r["total_ms"] for r in timed]),
        "prefix_hit_rate": round(sum(r["cached_tokens"] for r in ok) / prompt, 3) if prompt else None,
    }


# ------------------------------------------------------------------ hop (CPU)
async def hop(args: argparse.Namespace) -> dict[str, Any]:
    from voicebot.engines.registry import resolve_specs

    cfg = load_config(args.config, args.set)
    specs = await resolve_specs(cfg)
    model = specs.llm_path
    report: dict[str, Any] = {"kind": "hop", "config": args.config, "model": cfg.llm.model,
                              "versions": versions(), "llm_stage": {}, "voice_to_voice": {}}
    stage = dict(sessions=args.sessions, turns=args.turns, reply_tokens=args.reply_tokens, system=SYSTEM)

    sides = ("router", "inprocess") if args.v2v_side == "both" else (args.v2v_side,)
    if args.sessions:
        eng = LlmEngine(cfg.llm, model, specs.tokenizer_path)
        await eng.start()
        try:
            recs = await conversations(eng, eng.tokenizer, **stage)
        finally:
            await eng.aclose()
        report["llm_stage"]["inprocess"] = {**stage_summary(recs), "turns_detail": recs}
        print("inprocess", report["llm_stage"]["inprocess"]["ttft_ms"], flush=True)
        write(args.json, report, args=args)

    # The server gets the same vLLM knobs as the in-process engine of this config.
    c = cfg.llm
    # llm.dtype auto: the dtype the in-process engine resolved (float32 on a CPU without
    # native bf16); vLLM's own "auto" would take the model's bfloat16, emulated there.
    from voicebot.engines.llm.dtype import resolve_dtype

    extra = ["--dtype", resolve_dtype(c.dtype, on_cpu=True), "--seed", str(c.seed or 0)]
    if c.block_size:
        extra += ["--block-size", str(c.block_size)]
    if c.max_num_batched_tokens:
        extra += ["--max-num-batched-tokens", str(c.max_num_batched_tokens)]
    if c.enforce_eager:
        extra.append("--enforce-eager")
    env = {"VLLM_CPU_OMP_THREADS_BIND": c.cpu_threads_bind, "VLLM_CPU_KVCACHE_SPACE": str(c.kv_cache_space_gib)}
    if args.sessions or (args.v2v_turns and "router" in sides):
        # own_session=False: in its own session, kernel autogroup would give the server a full
        # core against the frontend's ASR and TTS, which the in-process engine never gets, and
        # the comparison would measure the scheduler (docs/benchmarks.md, remote LLM tier).
        async with llm_tier(model, 1, router=True, placement="none", server_extra=extra, server_env=env,
                            max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs, own_session=False) as tier:
            report["startup_s"] = tier.startup_s
            for name, url in (("direct", tier.servers[0].url), ("router", tier.url)) if args.sessions else ():
                rcfg = load_config(args.config, [*args.set, "llm.backend=remote", f"llm.remote.url={url}"])
                remote = RemoteLlmEngine(rcfg.llm, model)
                await remote.start()
                try:
                    recs = await conversations(remote, remote.tokenizer, **stage, seed=1 if name == "direct" else 2)
                finally:
                    await remote.aclose()
                report["llm_stage"][name] = {**stage_summary(recs), "turns_detail": recs}
                print(name, report["llm_stage"][name]["ttft_ms"], flush=True)
                write(args.json, report, args=args)
            if args.v2v_turns and "router" in sides:
                report["voice_to_voice"]["router"] = await voice_turns(
                    args, [f"llm.remote.url={tier.url}", "llm.backend=remote"], saver(args, report, "router"))
                write(args.json, report, args=args)
    if args.v2v_turns and "inprocess" in sides:
        report["voice_to_voice"]["inprocess"] = await voice_turns(args, [], saver(args, report, "inprocess"))
    write(args.json, report, args=args)
    return report


def cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far, by role: this process (the frontend: sessions, ASR, TTS,
    the in-process LLM's client side), the vLLM processes it started (in-process: the
    engine core and its worker; remote: the server's API process, engine core and
    worker), the router, and the whole machine (busy time, others' work included)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    out = {"frontend": t.user + t.system, "llm": 0.0, "router": 0.0}
    for child in me.children(recursive=True):
        try:
            cmd, ct = " ".join(child.cmdline()), child.cpu_times()
        except psutil.Error:
            continue  # gone meanwhile
        out["router" if "vllm-router" in cmd else "llm"] += ct.user + ct.system
    out["machine"] = cpu_busy_total(psutil.cpu_times())[0]
    return out


def event_ms(events: list[dict[str, Any]], kind: str, rid: str, since: float, last: bool = False) -> float | None:
    """When (ms after ``since``) the first (or last) ``kind`` event of reply ``rid`` arrived."""
    ts = [e["_t"] for e in events if e["type"] == kind and e.get("response_id", rid) == rid]
    return None if not ts else round(1000 * ((ts[-1] if last else ts[0]) - since), 1)


def v2v_summary(turns: list[dict[str, Any]], dones: list[dict[str, Any]]) -> dict[str, Any]:
    from v2v_stages import COLUMNS, stages

    keys = ("voice_to_voice_ms", "llm_ttft_ms", "asr_final_ms", "first_clause_ms", "tts_first_audio_ms")
    timings = [t["timings"] for t in turns]
    out: dict[str, Any] = {k: summarise_ms([t[k] for t in timings if t.get(k) is not None]) for k in keys}
    rows = [r for r in (stages(t) for t in turns) if r is not None]
    out["stages_ms"] = {c: summarise_ms([r[c] for r in rows]) for c in COLUMNS}
    window = sum(t["window_s"] for t in turns)
    out["cpu_cores_busy"] = {k: round(sum(t["cpu_s"][k] for t in turns) / window, 2) for k in turns[0]["cpu_s"]} if turns else {}
    prompt = sum(d.get("input_tokens", 0) for d in dones)
    out["prefix_hit_rate"] = round(sum(d.get("cached_tokens", 0) for d in dones) / prompt, 3) if prompt else None
    out["turns"] = turns
    return out


async def voice_turns(args: argparse.Namespace, overrides: list[str],
                      save: Callable[[dict[str, Any]], None] = lambda _: None) -> dict[str, Any]:
    """A real frontend; a caller says clips; the server's own turn timings, split into
    stages (benchmarks/v2v_stages.py), and the CPU each part of the system used per turn.
    ``save`` gets the summary so far after every turn (a run cut short keeps its turns);
    no turn starts after ``--stop-after-s`` (from the start of the process)."""
    from servers import NativeCall, running_server
    from speech import load_clips

    cfg = load_config(args.config, [*args.set, *overrides, "server.port=0", "server.transports=[native]"])
    clips = load_clips(cfg.models)
    turns: list[dict[str, Any]] = []  # the probe report's shape: what v2v_stages.py reads
    dones: list[dict[str, Any]] = []  # each reply's token counts (the remote ones known only at its end)
    async with running_server(cfg) as srv:
        call = await NativeCall.open(srv, system_prompt=SYSTEM)
        try:
            for i in range(args.v2v_turns):
                if args.stop_after_s and time.monotonic() - STARTED > args.stop_after_s:
                    print(f"  --stop-after-s {args.stop_after_s:g}: stopping after {i} turns", flush=True)
                    break
                mark = len(call.events)
                cpu0, t0 = cpu_seconds(), time.monotonic()
                spoken = await call.say(clips[i % len(clips)].audio)  # then silence until the reply is over
                timing = await call.wait_for("turn.timings", 120, after=mark)  # the reply that was heard
                rid = timing["response_id"]
                done = await call.wait_for("response.done", 120, after=mark, response_id=rid)
                cpu1, t1 = cpu_seconds(), time.monotonic()
                events = call.events[mark:]
                dones.append(done)
                turns.append({
                    "voice_to_voice_ms": timing.get("voice_to_voice_ms"), "timings": timing,
                    # ms after the clip's last frame was sent (clips end in some silence)
                    "events_ms": {"final": event_ms(events, "transcript.final", rid, spoken),
                                  "audio": event_ms(events, "response.audio.started", rid, spoken),
                                  "last_text": event_ms(events, "response.text.delta", rid, spoken, last=True),
                                  "done": event_ms(events, "response.done", rid, spoken)},
                    "output_tokens": done.get("output_tokens"),
                    "cpu_s": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0}, "window_s": round(t1 - t0, 2),
                })
                print(f"  turn {i}: {time.monotonic() - STARTED:.0f} s", {k: timing.get(k) for k in (
                    "voice_to_voice_ms", "asr_final_ms", "llm_ttft_ms", "first_clause_ms", "tts_first_audio_ms")},
                    flush=True)
                save(v2v_summary(turns, dones))
        finally:
            await call.close()
    out = v2v_summary(turns, dones)
    print("v2v", overrides or "inprocess", out["voice_to_voice_ms"], flush=True)
    print("  stages p50 " + "  ".join(f"{c} {v.get('p50')}" for c, v in out["stages_ms"].items()), flush=True)
    print("  cores busy", out["cpu_cores_busy"], flush=True)
    return out


# ------------------------------------------------------------------ GPU
async def gpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if torch.cuda.device_count() < 2:
        # One server per GPU here (placement "gpu", 0.85 of each): two on one GPU would
        # both ask for 0.85 of it. benchmarks/gpu_remote_tier.py shares one GPU between
        # two servers (each a fraction of its memory, started one after the other).
        raise SystemExit(f"gpu: needs 2 GPUs, {torch.cuda.device_count()} visible; "
                         "on one GPU run benchmarks/gpu_remote_tier.py")
    report: dict[str, Any] = {"kind": "gpu", "model_dir": args.model_dir, "versions": versions(), "scenarios": {}}
    extra = ["--load-format", "dummy", "--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "8192"]
    system = (SYSTEM * 40)[: args.system_tokens * 4]  # ~4 characters a token; trimmed below

    async def run(name: str, n_servers: int, router: bool, policy: str) -> None:
        async with llm_tier(args.model_dir, n_servers, router=router, policy=policy, placement="gpu",
                            server_extra=extra, max_model_len=4096, max_num_seqs=512, timeout_s=900) as tier:
            for sessions in args.sessions:
                rcfg = load_config(args.config, [*args.set, "llm.backend=remote", f"llm.remote.url={tier.url}",
                                                 f"llm.remote.max_connections={max(sessions * 2, 16)}"])
                eng = RemoteLlmEngine(rcfg.llm, args.model_dir)
                await eng.start()
                try:
                    tok = eng.tokenizer
                    ids = tok.encode(system, add_special_tokens=False)[: args.system_tokens]
                    until = time.monotonic() + args.duration_s
                    recs = await conversations(eng, tok, sessions=sessions, turns=0, reply_tokens=args.reply_tokens,
                                               system=tok.decode(ids), concurrent=True, think_s=tuple(args.think_s),
                                               until=until, min_tokens=args.reply_tokens, seed=sessions)
                finally:
                    await eng.aclose()
                s = stage_summary(recs, skip_first=False)
                s["startup_s"] = tier.startup_s
                report["scenarios"][f"{name}@{sessions}"] = s
                print(name, sessions, s["ttft_ms"], s["prefix_hit_rate"], flush=True)
                write(args.json, report, args=args)

    await run("one", 1, False, "round_robin")
    await run("two-affinity", 2, True, "sticky_least_loaded")
    await run("two-round", 2, True, "round_robin")
    return report


def table(report: dict[str, Any]) -> str:
    rows = []
    if report["kind"] == "hop":
        for name, s in report["llm_stage"].items():
            t = s["ttft_ms"]
            rows.append(f"llm {name:10s} TTFT p50 {t.get('p50')} p95 {t.get('p95')} ms  hit {s['prefix_hit_rate']}")
        for name, s in report["voice_to_voice"].items():
            v, t = s["voice_to_voice_ms"], s["llm_ttft_ms"]
            rows.append(f"v2v {name:10s} p50 {v.get('p50')} p95 {v.get('p95')} ms  TTFT p50 {t.get('p50')} ms"
                        f"  hit {s.get('prefix_hit_rate')}")
    else:
        for name, s in report["scenarios"].items():
            t = s["ttft_ms"]
            rows.append(f"{name:20s} TTFT p50 {t.get('p50')} p95 {t.get('p95')} ms  hit {s['prefix_hit_rate']}  errors {s['errors']}")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    sub = ap.add_subparsers(dest="part", required=True)
    h = sub.add_parser("hop", help="CPU: in-process vs HTTP hop vs router, same machine")
    h.add_argument("--config", default="configs/default.yaml")
    h.add_argument("--sessions", type=int, default=3, help="LLM-stage conversations (0: voice to voice only)")
    h.add_argument("--turns", type=int, default=6)
    h.add_argument("--reply-tokens", type=int, default=24)
    h.add_argument("--v2v-turns", type=int, default=6)
    h.add_argument("--stop-after-s", type=float, default=0.0,
                   help="start no voice turn after this many seconds of the run (0: no limit)")
    h.add_argument("--v2v-side", choices=("both", "inprocess", "router"), default="both",
                   help="which voice-to-voice run(s): one side per run keeps each run short")
    g = sub.add_parser("gpu", help="2 GPUs: one server vs two behind the router, affinity on/off")
    g.add_argument("--config", default="configs/gpu.yaml")
    g.add_argument("--model-dir", required=True, help="a model directory (config.json of the real shape suffices)")
    g.add_argument("--sessions", type=int, nargs="+", default=[64, 256])
    g.add_argument("--duration-s", type=float, default=30.0)
    g.add_argument("--system-tokens", type=int, default=400)
    g.add_argument("--reply-tokens", type=int, default=48)
    g.add_argument("--think-s", type=float, nargs=2, default=[2.0, 4.0])
    for p in (h, g):
        p.add_argument("--set", action="append", default=[], help="config override, e.g. llm.max_model_len=2048")
        p.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = asyncio.run(hop(args) if args.part == "hop" else gpu(args))
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
