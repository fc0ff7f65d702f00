"""LLM-stage load benchmark: our ``LlmEngine`` under a voice-shaped load, on a GPU.

    python benchmarks/llm_load.py --model-dir DIR --sessions 64 256 --duration-s 30 --json OUT

What it drives is the server's own code: ``voicebot.engines.llm.LlmEngine`` (lanes,
background cap) built from the ``llm`` section of ``--config`` (configs/gpu.yaml by
default) with ``load_format="dummy"`` (a config.json of the real model's shape is
enough: speed does not depend on the weights), and one
``voicebot.session.history.Conversation`` per simulated session, so every turn's
prompt extends the last and the prefix cache can hit.

Each session: the shared system prompt (~``--system-tokens``), then turns of a
~``--user-tokens`` utterance and a reply of exactly ``--reply-tokens`` tokens in the
INTERACTIVE lane, then ``--think-s`` of think time. Measured per turn: TTFT and TT10
(time to the 10th token, a first spoken clause), both from the call of
``LlmEngine.generate``; cached/prompt tokens; the time to build the prompt.

Scenarios, each bounded by ``--duration-s`` (turns in flight at the end finish):
  interactive  for each N in ``--sessions``: N sessions alone.
  bare         for each N in ``--bare-sessions``: the same load on vLLM's AsyncLLM
               directly (same engine, plain token concatenation): the reference.
  saturation   ``--sat-sessions`` sessions while ``--sat-requests`` BACKGROUND requests
               (lane cap off) fill every engine slot and queue behind them.
  background   ``--bg-sessions`` sessions plus ``--bg-requests`` workers that keep long
               BACKGROUND requests (``--bg-prompt-tokens`` unique prompt tokens,
               ``--bg-reply-tokens`` generated) outstanding, once per cap in
               ``--bg-caps`` (the lane's concurrency cap; 0 = uncapped).

``--phases`` runs engines one after another in the same process: ``main`` (the config
as is), ``fcfs`` (scheduling_policy fcfs: the saturation scenario again) and ``nocache``
(prefix caching off: ``--nocache-sessions``); the report's ``ratios`` compares them
(prefix cache off/on TTFT, FCFS/priority TTFT when saturated, ours/bare).

Prints a table at the end and writes JSON (rewritten after every scenario). Needs a
CUDA GPU with vLLM; stops by itself (``--max-wall-s`` is a hard stop as well).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_util import (  # noqa: E402, F401  (gpu_asr/gpu_tts import them from here too)
    JSON_EPILOG,
    bare_engines_package,
    pct,
    run_with_deadline,
    summarise,
    write_result,
)

from voicebot.config import LlmConfig, load_config  # noqa: E402  (pydantic, pyyaml)
from voicebot.session.history import Conversation  # noqa: E402  (no dependencies)

_ENGINE_MODULES = {"llm": "voicebot.engines.llm.inprocess", "llm_remote": "voicebot.engines.llm.remote"}


def load_engine_module(stem: str = "llm") -> Any:
    """The LLM engine module ``stem`` names (llm: in-process, llm_remote: the HTTP tier).
    ``voicebot.engines`` imports nothing on its own, so this needs only voicebot.config,
    voicebot.errors, voicebot.affinity (and aiohttp), none of the ASR, TTS or VAD stack."""
    return importlib.import_module(_ENGINE_MODULES[stem])


_llm = load_engine_module("llm")
LlmEngine = _llm.LlmEngine
Lane = _llm.Lane
GenerationStats = _llm.GenerationStats

log = logging.getLogger("llm_load")

SYSTEM_PARAGRAPHS = [
    "You are Ava, the voice assistant of Northline Rail, a regional train operator. You speak "
    "with travellers on the phone and in the app. Answer in one or two short spoken sentences; "
    "never use lists, markdown, emoji or abbreviations a speech synthesiser would stumble over.",
    "You can help with timetables, platform changes, delays and cancellations, ticket types and "
    "prices, season tickets, railcards, refunds and delay compensation, seat reservations, "
    "bicycles on trains, assistance for travellers with reduced mobility, lost property, and "
    "station facilities such as parking, lifts, toilets and ticket machines.",
    "When a traveller asks about a specific train, ask for the departure station, the "
    "destination and the approximate time if they have not given them. Read times in the "
    "twelve-hour clock with morning or evening, and read platform numbers as words.",
    "Delay compensation: delays of fifteen to twenty-nine minutes earn a quarter of the single "
    "fare back, thirty to fifty-nine minutes half, and an hour or more the full fare. Claims "
    "must be made within twenty-eight days through the website or the app, with the ticket.",
    "Refunds on unused advance tickets are not possible, but they can be changed before the "
    "departure of the booked train for a fee of ten pounds plus any difference in fare. Anytime "
    "and off-peak tickets can be refunded minus a ten pound administration fee.",
    "Bicycles: folding bicycles travel free at any time. Full-size bicycles need a free "
    "reservation on intercity services and are not allowed on local trains arriving in the city "
    "between seven and half past nine in the morning or leaving between four and seven.",
    "Assistance: travellers who need help boarding should book at least two hours ahead, "
    "although staff will always try to help without a booking. Ramps are available at every "
    "staffed station. Tell the traveller the number to call if they want to speak to a person.",
    "If you do not know an answer, say so briefly and offer to connect the caller to a member of "
    "staff. Never invent train times. Keep a calm, warm tone, especially with upset travellers, "
    "and do not repeat the question back to the caller before answering it.",
]

WORDS = (
    "when does the next train to the city leave from platform two and is it running late today "
    "i need a ticket for tomorrow morning can i bring my bike on the eight fifteen service how much "
    "is a return to the airport with a railcard my train was cancelled yesterday evening what can "
    "i claim back is there a lift at the central station could you check whether the coast line is "
    "open again after the storm i left my bag on the seven forty from the harbour where do i ask "
    "please tell me the quickest way to get to the university by rail on sunday afternoon thanks"
).split()


def build_system_prompt(tok: Any, target_tokens: int) -> str:
    parts: list[str] = []
    i = 0
    while len(tok.encode(" ".join(parts), add_special_tokens=False)) < target_tokens:
        parts.append(SYSTEM_PARAGRAPHS[i % len(SYSTEM_PARAGRAPHS)])
        i += 1
    text = " ".join(parts)
    ids = tok.encode(text, add_special_tokens=False)
    return tok.decode(ids[:target_tokens]).strip()


def build_utterances(tok: Any, n: int, target_tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(n):
        words: list[str] = []
        while True:
            words.append(rng.choice(WORDS))
            text = " ".join(words)
            if len(tok.encode(text, add_special_tokens=False)) >= target_tokens:
                break
        out.append(text[0].upper() + text[1:] + "?")
    return out


# --------------------------------------------------------------------------- stats
@dataclass
class Turn:
    session: int
    index: int
    started: float  # since the scenario's start, s
    ttft: float | None
    tt10: float | None
    total: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    build_s: float


@dataclass
class BgRequest:
    worker: int
    started: float
    waited: float  # in our lane queue, before vLLM saw it
    ttft: float | None
    total: float
    output_tokens: int


class Scenario:
    def __init__(self, name: str) -> None:
        self.name = name
        self.turns: list[Turn] = []
        self.bg: list[BgRequest] = []
        self.errors: list[str] = []
        self.bg_refused = 0


# ------------------------------------------------------------------------ workload
async def session_loop(
    engine: Any,
    conv: Conversation,
    sid: int,
    utterances: list[str],
    args: argparse.Namespace,
    sc: Scenario,
    t_start: float,
    t_end: float,
    rng: random.Random,
) -> None:
    await asyncio.sleep(rng.uniform(0.0, args.think_s[1]))  # stagger the first turns
    index = 0
    while time.monotonic() < t_end:
        user = utterances[rng.randrange(len(utterances))]
        b0 = time.perf_counter()
        prompt = conv.prompt_ids(user)
        build = time.perf_counter() - b0
        st = GenerationStats(request_id="", lane=Lane.INTERACTIVE)
        first = tenth = None
        n = 0
        parts: list[str] = []
        out_ids: list[int] = []
        t0 = time.monotonic()
        try:
            async for delta in engine.generate(
                prompt,
                lane=Lane.INTERACTIVE,
                max_tokens=args.reply_tokens,
                min_tokens=args.reply_tokens,  # dummy weights: no early EOS, fixed reply length
                stats=st,
            ):
                now = time.monotonic()
                n += delta.token_count
                if first is None and n >= 1:
                    first = now - t0
                if tenth is None and n >= 10:
                    tenth = now - t0
                parts.append(delta.text)
                out_ids.extend(delta.token_ids)
        except Exception as exc:  # noqa: BLE001 - record and go on
            sc.errors.append(f"session {sid}: {type(exc).__name__}: {exc}")
            return
        sc.turns.append(
            Turn(sid, index, t0 - t_start, first, tenth, time.monotonic() - t0,
                 st.prompt_tokens, st.cached_tokens, n, build)
        )
        b0 = time.perf_counter()
        conv.append("user", user)
        # What the model said, as its token ids, as the session stores a reply: the next
        # prompt then extends this one token for token and hits the prefix cache.
        conv.append("assistant", "".join(parts), token_ids=out_ids)
        if conv.over_budget():
            conv.trim()
        sc.turns[-1].build_s += time.perf_counter() - b0
        index += 1
        think = rng.uniform(*args.think_s)
        if time.monotonic() + think >= t_end:
            return  # the next turn would start after the end: stop now, not after the pause
        await asyncio.sleep(think)


async def background_loop(
    engine: Any, wid: int, args: argparse.Namespace, sc: Scenario, t_start: float, t_end: float,
    rng: random.Random,
) -> None:
    await asyncio.sleep(rng.uniform(0.0, args.bg_start_spread_s))
    while time.monotonic() < t_end:
        # Unique random ids (no special tokens): every background prompt is a cache miss.
        prompt = [rng.randrange(0, 151_000) for _ in range(args.bg_prompt_tokens)]
        st = GenerationStats(request_id="", lane=Lane.BACKGROUND)
        t0 = time.monotonic()
        n = 0
        try:
            async for delta in engine.generate(
                prompt,
                lane=Lane.BACKGROUND,
                max_tokens=args.bg_reply_tokens,
                min_tokens=args.bg_reply_tokens,
                stats=st,
            ):
                n += delta.token_count
        except Exception as exc:  # noqa: BLE001
            if getattr(exc, "code", None) == "background_queue_full":
                sc.bg_refused += 1  # the lane's bounded queue said no: try again shortly
                await asyncio.sleep(0.2)
                continue
            sc.errors.append(f"background {wid}: {type(exc).__name__}: {exc}")
            return
        sc.bg.append(
            BgRequest(wid, t0 - t_start, st.submitted_at - t0, st.ttft_s, time.monotonic() - t0, n)
        )
        if args.bg_pause_s[1] > 0:
            await asyncio.sleep(rng.uniform(*args.bg_pause_s))


class BarePrompts:
    """Bare-vLLM prompts: ChatML token ids built by plain concatenation, no Conversation.

    The same shape as our sessions' prompts (system, then user/assistant turns, each
    reply appended as the ids the model generated), as a driver of AsyncLLM alone would
    build them: the reference our LlmEngine + Conversation is compared with.
    """

    def __init__(self, tok: Any, system_prompt: str) -> None:
        self.tok = tok
        text = tok.apply_chat_template([{"role": "system", "content": system_prompt}], tokenize=False)
        self.system = tok.encode(text, add_special_tokens=False)
        self.close = tok.encode("<|im_end|>\n", add_special_tokens=False)

    def user(self, text: str) -> list[int]:
        return self.tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                               add_special_tokens=False)


async def bare_session_loop(
    engine: Any,
    bare: BarePrompts,
    sid: int,
    utterances: list[str],
    args: argparse.Namespace,
    sc: Scenario,
    t_start: float,
    t_end: float,
    rng: random.Random,
) -> None:
    """``session_loop`` driving vLLM's AsyncLLM directly (same load, same engine)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = engine._engine  # the AsyncLLM inside our LlmEngine: nothing of ours in between
    c = engine.cfg
    params = SamplingParams(max_tokens=args.reply_tokens, min_tokens=args.reply_tokens,
                            temperature=c.temperature, top_p=c.top_p, output_kind=RequestOutputKind.DELTA)
    history = list(bare.system)
    await asyncio.sleep(rng.uniform(0.0, args.think_s[1]))
    index = 0
    while time.monotonic() < t_end:
        b0 = time.perf_counter()
        prompt = history + bare.user(utterances[rng.randrange(len(utterances))])
        build = time.perf_counter() - b0
        rid = f"bare{sid}-{index}"
        first = tenth = None
        cached = 0
        out_ids: list[int] = []
        t0 = time.monotonic()
        try:
            async for out in llm.generate({"prompt_token_ids": prompt}, params, rid, priority=0):
                now = time.monotonic()
                if out.num_cached_tokens is not None and first is None:
                    cached = out.num_cached_tokens
                out_ids.extend(out.outputs[0].token_ids)
                if first is None and out_ids:
                    first = now - t0
                if tenth is None and len(out_ids) >= 10:
                    tenth = now - t0
        except Exception as exc:  # noqa: BLE001
            sc.errors.append(f"bare session {sid}: {type(exc).__name__}: {exc}")
            return
        sc.turns.append(Turn(sid, index, t0 - t_start, first, tenth, time.monotonic() - t0,
                             len(prompt), cached, len(out_ids), build))
        history = prompt + out_ids + bare.close
        index += 1
        think = rng.uniform(*args.think_s)
        if time.monotonic() + think >= t_end:
            return
        await asyncio.sleep(think)


async def run_scenario(
    engine: Any,
    tok: Any,
    system_prompt: str,
    utterances: list[str],
    args: argparse.Namespace,
    name: str,
    sessions: int,
    bg_workers: int = 0,
    bg_cap: int | None = None,
    bare: BarePrompts | None = None,
) -> dict[str, Any]:
    sc = Scenario(name)
    budget = args.history_tokens
    convs = [Conversation(tok, system_prompt, budget, args.reply_tokens) for _ in range(sessions)]
    saved_cap = engine.background_limit
    if bg_cap is not None:
        engine.background_limit = bg_cap if bg_cap > 0 else 1_000_000
    p0, c0, r0 = engine.prompt_tokens_total, engine.cached_tokens_total, engine.requests_total
    t_start = time.monotonic()
    t_end = t_start + args.duration_s
    base = random.Random(f"{args.seed}-{name}")
    if bare is not None:
        tasks = [
            asyncio.create_task(bare_session_loop(engine, bare, i, utterances, args, sc, t_start, t_end,
                                                  random.Random(base.random())))
            for i in range(sessions)
        ]
    else:
        tasks = [
            asyncio.create_task(session_loop(engine, convs[i], i, utterances, args, sc, t_start, t_end,
                                             random.Random(base.random())))
            for i in range(sessions)
        ]
    tasks += [
        asyncio.create_task(background_loop(engine, w, args, sc, t_start, t_end, random.Random(base.random())))
        for w in range(bg_workers)
    ]
    # Background peak of our lane, sampled while it runs.
    peak = {"bg_running": 0, "bg_waiting": 0, "running": 0}

    async def sample() -> None:
        while True:
            peak["bg_running"] = max(peak["bg_running"], engine.background_running)
            peak["bg_waiting"] = max(peak["bg_waiting"], engine.background_waiting)
            peak["running"] = max(peak["running"], engine.running)
            await asyncio.sleep(0.05)

    # Event-loop lag: how late a 5 ms sleep wakes up. TTFT is read on this loop, so a
    # busy loop (output processing, prompt building) shows up in TTFT as well.
    lags: list[float] = []

    async def lag_probe() -> None:
        while True:
            a = time.monotonic()
            await asyncio.sleep(0.005)
            lags.append(time.monotonic() - a - 0.005)

    sampler = asyncio.create_task(sample())
    prober = asyncio.create_task(lag_probe())
    cpu0 = os.times()
    # Sessions finish the turn in flight at t_end (background load goes on meanwhile);
    # then the background requests still queued or running are cut (the abort path).
    _, late = await asyncio.wait(tasks[:sessions], timeout=args.duration_s + args.drain_s)
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    sampler.cancel()
    prober.cancel()
    cpu1 = os.times()
    wall = time.monotonic() - t_start
    engine.background_limit = saved_cap

    measured = [t for t in sc.turns if t.started >= args.warmup_s]
    ttft = [t.ttft for t in measured if t.ttft is not None]
    tt10 = [t.tt10 for t in measured if t.tt10 is not None]
    prompt_tok = sum(t.prompt_tokens for t in measured)
    cached_tok = sum(t.cached_tokens for t in measured)
    dp, dc = engine.prompt_tokens_total - p0, engine.cached_tokens_total - c0
    out_tok = sum(t.output_tokens for t in sc.turns) + sum(b.output_tokens for b in sc.bg)
    res: dict[str, Any] = {
        "name": name,
        "driver": "bare-vllm" if bare is not None else "LlmEngine+Conversation",
        "engine_policy": engine.cfg.scheduling_policy,
        "prefix_caching": engine.cfg.enable_prefix_caching,
        "sessions": sessions,
        "duration_s": args.duration_s,
        "wall_s": round(wall, 2),
        "turns": len(sc.turns),
        "turns_measured": len(measured),
        "ttft_ms": summarise(ttft),
        "tt10_ms": summarise(tt10),
        "turn_total_ms": summarise([t.total for t in measured]),
        "prompt_build_ms": summarise([t.build_s for t in measured]),
        "prompt_tokens_mean": round(prompt_tok / len(measured), 1) if measured else None,
        "interactive_cache_hit": round(cached_tok / prompt_tok, 4) if prompt_tok else None,
        "engine_cache_hit": round(dc / dp, 4) if dp else None,
        "engine_requests": engine.requests_total - r0,
        "turns_per_s": round(len(sc.turns) / args.duration_s, 2),
        "output_tokens_per_s": round(out_tok / wall, 1),
        "short_replies": sum(1 for t in sc.turns if t.output_tokens != args.reply_tokens),
        "peak": peak,
        "loop_lag_ms": summarise(lags),
        # CPU seconds per wall second of this (the API) process, all its threads; the
        # engine core is a separate process.
        "api_process_cpu": round((cpu1.user - cpu0.user + cpu1.system - cpu0.system) / wall, 2),
        "errors": sc.errors[:20],
        "n_errors": len(sc.errors),
        "sessions_cut": len(late),
        # Every turn: [start s, TTFT ms, TT10 ms, prompt tokens, cached tokens] (time series).
        "raw_turns": [[round(t.started, 3), round((t.ttft or 0) * 1000, 1), round((t.tt10 or 0) * 1000, 1),
                       t.prompt_tokens, t.cached_tokens] for t in sc.turns],
    }
    if bg_workers:
        res["background"] = {
            "workers": bg_workers,
            "cap": bg_cap,
            "prompt_tokens": args.bg_prompt_tokens,
            "reply_tokens": args.bg_reply_tokens,
            "completed": len(sc.bg),
            # The lane cap's fairness: how many workers ever got a slot, and the spread.
            "workers_served": len({b.worker for b in sc.bg}),
            "refused_queue_full": sc.bg_refused,
            "per_worker_max": max((sum(1 for b in sc.bg if b.worker == w) for w in range(bg_workers)), default=0),
            "cut_at_end": len(pending) - len(late),
            "lane_wait_ms": summarise([b.waited for b in sc.bg]),
            "ttft_ms": summarise([b.ttft for b in sc.bg if b.ttft is not None]),
            "total_ms": summarise([b.total for b in sc.bg]),
            "tokens_per_s": round(sum(b.output_tokens for b in sc.bg) / wall, 1),
            "start_spread_s": args.bg_start_spread_s,
            "pause_s": args.bg_pause_s,
            "raw": [[b.worker, round(b.started, 3), round(b.waited * 1000, 1), round((b.ttft or 0) * 1000, 1),
                     round(b.total * 1000, 1)] for b in sc.bg],
        }
    return res


# ----------------------------------------------------------------------------- main
def device_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    v: dict[str, str] = {"python": sys.version.split()[0]}
    for mod in ("vllm", "torch", "transformers", "flashinfer"):
        try:
            v[mod] = str(__import__(mod).__version__)
        except Exception:  # noqa: BLE001
            v[mod] = "n/a"
    return v


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'scenario':<26}{'sess':>5}{'turns':>7}{'TTFT p50/p95/p99 ms':>24}"
            f"{'TT10 p50/p95 ms':>18}{'hit %':>8}{'bg done':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        f, t = r["ttft_ms"], r["tt10_ms"]
        ttft = f"{f.get('p50')}/{f.get('p95')}/{f.get('p99')}"
        tt10 = f"{t.get('p50')}/{t.get('p95')}"
        hit = r["interactive_cache_hit"]
        bg = r.get("background", {}).get("completed", "")
        lines.append(f"{r['name']:<26}{r['sessions']:>5}{r['turns_measured']:>7}{ttft:>24}{tt10:>18}"
                     f"{(hit or 0) * 100:>8.1f}{bg!s:>9}")
    return "\n".join(lines)


def ratios(scenarios: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparisons asked for, from the scenarios that ran (absent ones are skipped)."""
    by = {r["name"]: r for r in scenarios}
    out: dict[str, Any] = {}

    def cmp(a: str, b: str, key: str) -> dict[str, Any] | None:
        if a not in by or b not in by:
            return None
        ra, rb = by[a][key], by[b][key]
        res: dict[str, Any] = {"of": a, "over": b, "metric": key}
        for q in ("p50", "p95", "p99"):
            if ra.get(q) and rb.get(q):
                res[q] = round(ra[q] / rb[q], 2)
                res[f"{q}_ms"] = [ra[q], rb[q]]
        return res

    for r in scenarios:
        name = r["name"]
        if name.startswith("nocache/interactive-"):
            n = name.rsplit("-", 1)[1]
            out[f"prefix_cache_off_over_on_ttft_{n}"] = cmp(name, f"main/interactive-{n}", "ttft_ms")
        if name.startswith("fcfs/sat"):
            out["fcfs_over_priority_ttft_saturated"] = cmp(name, "main/" + name.split("/", 1)[1], "ttft_ms")
            out["fcfs_over_priority_tt10_saturated"] = cmp(name, "main/" + name.split("/", 1)[1], "tt10_ms")
        if name.startswith("main/bare-"):
            n = name.rsplit("-", 1)[1]
            out[f"ours_over_bare_ttft_{n}"] = cmp(f"main/interactive-{n}", name, "ttft_ms")
            out[f"ours_over_bare_tt10_{n}"] = cmp(f"main/interactive-{n}", name, "tt10_ms")
    return {k: v for k, v in out.items() if v is not None}


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    full = load_config(args.config)
    overrides = dict(kv.split("=", 1) for kv in args.llm_set)
    cfg = LlmConfig(**{**full.llm.model_dump(), "model": str(args.model_dir), "tokenizer": None,
                       "load_format": args.load_format, **overrides})
    if args.background_concurrency is not None:
        cfg.background_concurrency = args.background_concurrency
    args.history_tokens = args.history_tokens or full.session.history_tokens

    tok = AutoTokenizer.from_pretrained(str(args.model_dir))
    system_prompt = build_system_prompt(tok, args.system_tokens)
    utterances = build_utterances(tok, 2048, args.user_tokens, args.seed)
    probe = Conversation(tok, system_prompt, args.history_tokens, args.reply_tokens)
    report: dict[str, Any] = {
        "device": device_name(),
        "versions": versions(),
        "model_dir": str(args.model_dir),
        "model_config": json.loads((Path(args.model_dir) / "config.json").read_text()),
        "llm_config": cfg.model_dump(),
        "llm_overrides": overrides,
        "workload": {
            "system_prompt_tokens": len(tok.encode(system_prompt, add_special_tokens=False)),
            "first_prompt_tokens": len(probe.prompt_ids(utterances[0])),
            "user_tokens_mean": round(sum(len(tok.encode(u, add_special_tokens=False))
                                          for u in utterances[:256]) / 256, 1),
            "reply_tokens": args.reply_tokens,
            "think_s": args.think_s,
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "history_tokens": args.history_tokens,
        },
        "argv": sys.argv,
        "scenarios": [],
    }

    def dump() -> None:
        if args.json:
            write_result(args.json, "llm_load", args, report)

    engine: Any = None

    async def start_engine(phase: str, phase_cfg: Any) -> Any:
        eng = LlmEngine(phase_cfg, str(args.model_dir))
        t0 = time.monotonic()
        await eng.start()
        took = round(time.monotonic() - t0, 1)
        report.setdefault("engine_start_s", took)
        report.setdefault("phase_engine_start_s", {})[phase] = took
        print(f"[llm_load] {phase}: engine up in {took} s on {report['device']}", flush=True)
        # Warm-up: a short burst at several batch sizes, not measured.
        for batch in (1, 16, 64):
            conv = Conversation(tok, system_prompt, args.history_tokens, args.reply_tokens)
            await asyncio.gather(*[
                eng.complete(conv.prompt_ids(utterances[i]), max_tokens=args.reply_tokens,
                             min_tokens=args.reply_tokens)
                for i in range(batch)
            ])
        print(f"[llm_load] {phase}: warm-up done", flush=True)
        return eng

    async def run(eng: Any, phase: str, name: str, sessions: int, **kw: Any) -> None:
        res = await run_scenario(eng, tok, system_prompt, utterances, kw.pop("args", args),
                                 f"{phase}/{name}", sessions, **kw)
        res["phase"] = phase
        report["scenarios"].append(res)
        dump()
        bg = f" bg {res['background']['completed']} done, peak {res['peak']}" if "background" in res else ""
        print(f"[llm_load] {res['name']}: TTFT {res['ttft_ms']} TT10 {res['tt10_ms']} "
              f"hit {res['interactive_cache_hit']} errors {res['n_errors']}{bg}", flush=True)

    # Saturation: background requests that fill every engine slot and queue behind
    # them (lane cap off), so only the engine's scheduling policy decides who goes next.
    sat_args = argparse.Namespace(**{**vars(args), "bg_prompt_tokens": args.sat_prompt_tokens,
                                     "bg_reply_tokens": args.sat_reply_tokens,
                                     "bg_start_spread_s": args.sat_start_spread_s, "bg_pause_s": [0.0, 0.0]})
    phase_overrides = {"main": {}, "fcfs": {"scheduling_policy": "fcfs"},
                       "nocache": {"enable_prefix_caching": False}}
    try:
        for phase in args.phases:
            phase_cfg = LlmConfig(**{**cfg.model_dump(), **phase_overrides[phase]})
            if engine is not None:
                await engine.aclose()
                engine = None
                await asyncio.sleep(3)  # the engine-core process gives its GPU memory back
            engine = await start_engine(phase, phase_cfg)
            if phase == "main":
                for n in args.sessions:
                    await run(engine, phase, f"interactive-{n}", n)
                for n in args.bare_sessions:
                    await run(engine, phase, f"bare-{n}", n, bare=BarePrompts(tok, system_prompt))
                if args.bg_requests > 0:
                    for cap in args.bg_caps:
                        label = f"bg{args.bg_requests}-cap{cap if cap > 0 else 'off'}"
                        await run(engine, phase, f"{label}-{args.bg_sessions}", args.bg_sessions,
                                  bg_workers=args.bg_requests, bg_cap=cap)
            if phase == "nocache":
                for n in args.nocache_sessions:
                    await run(engine, phase, f"interactive-{n}", n)
            if phase in ("main", "fcfs") and args.sat_requests > 0:
                await run(engine, phase, f"sat{args.sat_requests}-{args.sat_sessions}", args.sat_sessions,
                          bg_workers=args.sat_requests, bg_cap=0, args=sat_args)
            report.setdefault("unfinished_after", {})[phase] = engine.unfinished_requests()
            report.setdefault("engine_cache_hit_ratio_total", {})[phase] = round(engine.cache_hit_ratio, 4)
            dump()
        report["ratios"] = ratios(report["scenarios"])
        dump()
    finally:
        if engine is not None:
            await engine.aclose()
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("--model-dir", required=True, type=Path, help="config.json + tokenizer (weights not needed with dummy)")
    p.add_argument("--config", default=str(ROOT / "configs" / "gpu.yaml"), help="YAML whose llm section is used")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--sessions", type=int, nargs="*", default=[64, 256])
    p.add_argument("--bare-sessions", type=int, nargs="*", default=[],
                   help="the same load driven on vLLM's AsyncLLM directly (same engine): the reference")
    p.add_argument("--phases", nargs="+", default=["main"], choices=["main", "fcfs", "nocache"],
                   help="engines run one after another: main (config as is), fcfs (scheduling_policy fcfs: "
                        "the saturation scenario again), nocache (prefix caching off: --nocache-sessions)")
    p.add_argument("--nocache-sessions", type=int, nargs="*", default=[256])
    p.add_argument("--sat-sessions", type=int, default=128, help="interactive sessions beside the saturation")
    p.add_argument("--sat-requests", type=int, default=0,
                   help="background requests kept outstanding with the lane cap off (0: skip saturation)")
    p.add_argument("--sat-prompt-tokens", type=int, default=256)
    p.add_argument("--sat-reply-tokens", type=int, default=512)
    p.add_argument("--sat-start-spread-s", type=float, default=2.0)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=2.0, help="turns that start earlier are not counted")
    p.add_argument("--drain-s", type=float, default=30.0, help="wait this long for turns in flight at the end")
    p.add_argument("--system-tokens", type=int, default=400)
    p.add_argument("--user-tokens", type=int, default=20)
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--think-s", type=float, nargs=2, default=[2.0, 4.0])
    p.add_argument("--history-tokens", type=int, default=None, help="default: the config's session.history_tokens")
    p.add_argument("--bg-sessions", type=int, default=64, help="interactive sessions in the background scenarios")
    p.add_argument("--bg-requests", type=int, default=64, help="background requests kept outstanding (0: skip)")
    p.add_argument("--bg-caps", type=int, nargs="+", default=[32], help="background lane caps to run (0 = uncapped)")
    p.add_argument("--bg-prompt-tokens", type=int, default=2048)
    p.add_argument("--bg-reply-tokens", type=int, default=512)
    p.add_argument("--bg-start-spread-s", type=float, default=0.0, help="background workers start within this window")
    p.add_argument("--bg-pause-s", type=float, nargs=2, default=[0.0, 0.0], help="pause between a worker's requests")
    p.add_argument("--llm-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field of the llm section (e.g. max_num_batched_tokens=2048)")
    p.add_argument("--background-concurrency", type=int, default=None, help="override the config's cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--max-wall-s", type=float, default=570.0, help="hard stop for the whole run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    report = run_with_deadline(amain(args), args.max_wall_s, "llm_load")
    print()
    print(f"device: {report['device']}  versions: {report['versions']}  engine start: {report['engine_start_s']} s")
    print(f"workload: {report['workload']}")
    for r in report["scenarios"]:
        if "background" in r:
            b = r["background"]
            print(f"{r['name']}: background completed {b['completed']}, {b['tokens_per_s']} tok/s, "
                  f"lane wait p50/max {b['lane_wait_ms'].get('p50')}/{b['lane_wait_ms'].get('max')} ms, "
                  f"workers served {b['workers_served']}/{b['workers']}, peak {r['peak']}")
        print(f"{r['name']}: prompt build p50/p95 {r['prompt_build_ms'].get('p50')}/"
              f"{r['prompt_build_ms'].get('p95')} ms, prompt mean {r['prompt_tokens_mean']} tok, "
              f"short replies {r['short_replies']}, errors {r['n_errors']}, loop lag p50/p99/max "
              f"{r['loop_lag_ms'].get('p50')}/{r['loop_lag_ms'].get('p99')}/{r['loop_lag_ms'].get('max')} ms, "
              f"API process CPU {r['api_process_cpu']}")
    print(table(report["scenarios"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
