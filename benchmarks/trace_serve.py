"""What runs on the 2 cores while a live turn waits: a traced ``voicebot serve``.

    TRACE_OUT=artifacts/x/trace.jsonl .venv/bin/python benchmarks/trace_serve.py serve --config ...
    TRACE=1 benchmarks/voice_loop.sh configs/default.yaml OUT ...
    .venv/bin/python benchmarks/trace_serve.py --report OUT/trace.jsonl

The server is the real one (``voicebot.cli.main``); before it starts, a few of our own
functions are wrapped to write one JSON line per event, on ``time.monotonic()`` (the
engine core's clock too, so vLLM's own per-request timestamps line up):

    asr        a Whisper decode: priority (final / partial), audio seconds, start, end
    llm        an LLM request: lane, prompt / cached tokens, submitted, vLLM's queued /
               scheduled / first-token marks, our first token, end, aborted or not
    signal     a turn signal (quiet, pause, resume, end, speech_start)
    smart_turn the end-of-turn model's inference, start and end
    tts        one Piper sentence, start and end
    summary    a background history summary, start and end
    history    the history's start changed: a compaction swapped in (``swap``), a trim's
               summary swapped in (``summary``), turns dropped at the budget (``trim``)
    loop_lag   the event loop was late by more than 20 ms (something held it)

``--report`` prints, for every interactive LLM request, its TTFT split into vLLM's
queue and prefill time and every piece of work that overlapped it, so a slow TTFT
can be pinned on what ran at that moment; and the first reply after each change of the
history's start (what a long call pays for its budget). Nothing here changes what the
server does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_util import JSON_EPILOG, summarise, summarise_ms, write_result  # same folder

_lock = threading.Lock()
_out: Any = None


def _emit(kind: str, **fields: Any) -> None:
    if _out is None:
        return
    line = json.dumps({"kind": kind, **fields}, default=str)
    with _lock:
        _out.write(line + "\n")
        _out.flush()


def install(path: str) -> None:
    """Wrap the functions whose timing matters; events go to ``path`` (JSON lines)."""
    global _out
    _out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    from voicebot.engines.asr import local as asr
    from voicebot.engines.llm import inprocess as llm
    from voicebot.engines.tts import piper as tts_piper
    from voicebot.engines.turn import smart_turn
    from voicebot.session import background, history, listener, session

    asr.LocalWhisper._decode = _span(  # type: ignore[method-assign]
        "asr", asr.LocalWhisper._decode,
        lambda self, job: {"priority": job.priority.name.lower(), "audio_s": round(job.audio.size / 16000, 3)},
    )

    from vllm.v1.engine.async_llm import AsyncLLM

    recs: dict[str, dict[str, Any]] = {}
    generate = AsyncLLM.generate

    async def spy(self: Any, prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        rec = recs.get(request_id, {})
        async with contextlib.aclosing(generate(self, prompt, params, request_id, *args, **kwargs)) as outs:
            async for out in outs:
                m = getattr(out, "metrics", None)
                if m is not None and "vllm_first_token" not in rec and getattr(m, "first_token_ts", 0):
                    rec["vllm_queued"] = m.queued_ts
                    rec["vllm_scheduled"] = m.scheduled_ts
                    rec["vllm_first_token"] = m.first_token_ts
                yield out

    AsyncLLM.generate = spy  # type: ignore[method-assign]
    stream = llm.LlmEngine._stream

    async def traced_stream(self: Any, rid: str, prompt_ids: list[int], lane: Any, st: Any, params: Any) -> Any:
        rec = recs[rid] = {"rid": rid, "lane": lane.value, "prompt_tokens": len(prompt_ids)}
        rec["submitted"] = time.monotonic()
        aborted = True
        try:
            async with contextlib.aclosing(stream(self, rid, prompt_ids, lane, st, params)) as inner:
                async for delta in inner:
                    if "first_token" not in rec:
                        rec["first_token"] = time.monotonic()
                    yield delta
            aborted = False
        finally:
            recs.pop(rid, None)
            rec.update(end=time.monotonic(), cached_tokens=st.cached_tokens, output_tokens=st.output_tokens,
                       aborted=aborted)
            _emit("llm", **rec)

    llm.LlmEngine._stream = traced_stream  # type: ignore[method-assign]

    on_signal = listener.Listener._on_signal

    def traced_signal(self: Any, sig: Any) -> bool:
        _emit("signal", name=sig.value, at=time.monotonic(), session=self.call.id)
        return on_signal(self, sig)

    listener.Listener._on_signal = traced_signal  # type: ignore[method-assign]

    smart_turn.SmartTurn._timed = _span(  # type: ignore[method-assign]
        "smart_turn", smart_turn.SmartTurn._timed, lambda self, audio: {"audio_s": round(audio.size / 16000, 3)}
    )
    tts_piper._synth_sentence = _span("tts", tts_piper._synth_sentence, lambda voice, text, *_: {"chars": len(text)})

    summary_of = background.BackgroundWork._summary_of

    async def traced_summary(self: Any, dropped: Any, earlier: Any) -> str:
        t0 = time.monotonic()
        try:
            return await summary_of(self, dropped, earlier)
        finally:
            _emit("summary", start=t0, end=time.monotonic(), messages=len(dropped))

    background.BackgroundWork._summary_of = traced_summary  # type: ignore[method-assign]

    compact, trim = history.Conversation.compact, history.Conversation.trim

    def traced_compact(self: Any, head: Any, summary: Any) -> bool:
        done = compact(self, head, summary)
        if done:
            _emit("history", what="swap" if head else "summary", at=time.monotonic(), tokens=self.token_count)
        return done

    def traced_trim(self: Any) -> Any:
        dropped = trim(self)
        if dropped:
            _emit("history", what="trim", at=time.monotonic(), tokens=self.token_count)
        return dropped

    history.Conversation.compact = traced_compact  # type: ignore[method-assign]
    history.Conversation.trim = traced_trim  # type: ignore[method-assign]

    aenter = session.Session.__aenter__

    async def traced_aenter(self: Any) -> Any:
        out = await aenter(self)
        if not getattr(session, "_lag_watch", None):
            session._lag_watch = asyncio.get_running_loop().create_task(_watch_lag())  # type: ignore[attr-defined]
        return out

    session.Session.__aenter__ = traced_aenter  # type: ignore[method-assign]


def _span(kind: str, fn: Callable[..., Any], fields: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
    """``fn`` (a function or method run on a worker thread), emitting one ``kind`` event per
    call with its start, end and ``fields(*args)``."""

    def traced(*args: Any) -> Any:
        t0 = time.monotonic()
        extra: dict[str, Any] = {}
        try:
            return fn(*args)
        except BaseException as exc:
            extra["error"] = type(exc).__name__  # DecodeAbandoned: a stale decode stopped early
            raise
        finally:
            _emit(kind, start=t0, end=time.monotonic(), **fields(*args), **extra)

    return traced


async def _watch_lag(step: float = 0.01, report_over: float = 0.02) -> None:
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(step)
        late = time.monotonic() - t0 - step
        if late > report_over:
            _emit("loop_lag", start=t0 + step, end=time.monotonic(), late_ms=round(1000 * late, 1))


# ------------------------------------------------------------------------- report
def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def report(path: Path) -> int:
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    llm_reqs = sorted((e for e in events if e["kind"] == "llm"), key=lambda e: e["submitted"])
    work = [e for e in events if e["kind"] in ("asr", "smart_turn", "tts", "summary", "loop_lag")]
    work += [
        {**e, "kind": f"llm:{e['lane']}", "start": e["submitted"], "end": e["end"]}
        for e in events if e["kind"] == "llm"
    ]
    signals = sorted((e for e in events if e["kind"] == "signal"), key=lambda e: e["at"])
    rows = []
    for r in llm_reqs:
        if r["lane"] != "interactive" or "first_token" not in r:
            continue
        t0, t1 = r["submitted"], r["first_token"]
        ttft = 1000 * (t1 - t0)
        split = ""
        if r.get("vllm_first_token"):
            queue = 1000 * (r["vllm_scheduled"] - t0)
            prefill = 1000 * (r["vllm_first_token"] - r["vllm_scheduled"])
            split = f"to scheduled {queue:6.0f}  prefill {prefill:6.0f}"
        busy: dict[str, float] = {}
        for w in work:
            if w is r or (w.get("rid") == r["rid"]):
                continue
            ov = _overlap(t0, t1, w["start"], w["end"])
            if ov > 0:
                key = w["kind"] + (f":{w['priority']}" if w["kind"] == "asr" else "")
                busy[key] = busy.get(key, 0.0) + 1000 * ov
        recent = [s["name"] for s in signals if t0 - 1.0 <= s["at"] <= t1]
        rows.append({"rid": r["rid"], "ttft_ms": round(ttft, 1), "cached": r["cached_tokens"],
                     "prompt": r["prompt_tokens"], "aborted": r["aborted"], "overlap_ms": busy,
                     "signals_1s_before": recent})
        over = ", ".join(f"{k} {v:.0f}" for k, v in sorted(busy.items())) or "-"
        print(f"{r['rid']:>6} ttft {ttft:6.0f} ms  {split}  cached {r['cached_tokens']}/{r['prompt_tokens']}"
              f"{'  ABORTED' if r['aborted'] else ''}  overlapped: {over}  signals: {' '.join(recent)}")
    smart = smart_turn_cost(events)
    for k, v in smart.items():
        print(f"smart turn: {k}: {v}")
    after = after_history(events, rows, llm_reqs)
    for a in after:
        print(f"after {a['what']:>7}: ttft {a['ttft_ms']:6.0f} ms  to prefill {a['prompt'] - a['cached']}"
              f" of {a['prompt']}  ({a['after_s']:.1f} s after it)")
    write_result(path.with_suffix(".report.json"), "trace_serve", {"report": str(path)},
                 {"ttft_ms": summarise_ms(r["ttft_ms"] for r in rows), "requests": rows, "smart_turn": smart,
                  "after_history": after, "ttft_after_history_ms": summarise_ms(a["ttft_ms"] for a in after)})
    return 0


def after_history(events: list[dict], rows: list[dict], llm_reqs: list[dict]) -> list[dict[str, Any]]:
    """The first interactive request (that produced a token) after each change of the
    history's start: its prompt then starts with what a background prefill had to cover."""
    submitted = {r["rid"]: r["submitted"] for r in llm_reqs}
    replies = sorted(rows, key=lambda r: submitted[r["rid"]])
    out = []
    for h in sorted((e for e in events if e["kind"] == "history"), key=lambda e: e["at"]):
        nxt = next((r for r in replies if submitted[r["rid"]] > h["at"]), None)
        if nxt is not None:
            out.append({"what": h["what"], "tokens": h["tokens"], "rid": nxt["rid"], "ttft_ms": nxt["ttft_ms"],
                        "prompt": nxt["prompt"], "cached": nxt["cached"],
                        "after_s": round(submitted[nxt["rid"]] - h["at"], 3)})
    return out


def smart_turn_cost(events: list[dict]) -> dict[str, dict[str, Any]]:
    """What Smart Turn's inference costs the work beside it: Whisper decodes (not beside
    an LLM request) and interactive LLM prefills (vLLM's scheduled to first token, per
    new prompt token), each split by whether a Smart Turn inference overlapped it."""
    st = [e for e in events if e["kind"] == "smart_turn"]
    llm = [e for e in events if e["kind"] == "llm"]
    out: dict[str, list[float]] = {k: [] for k in (
        "decode_ms_beside_smart_turn", "decode_ms_alone", "prefill_ms_per_new_token_beside_smart_turn",
        "prefill_ms_per_new_token_alone", "prefill_ms_beside_smart_turn", "prefill_ms_alone", "smart_turn_ms")}
    out["smart_turn_ms"] = [1000 * (e["end"] - e["start"]) for e in st]
    for d in (e for e in events if e["kind"] == "asr"):
        if any(_overlap(d["start"], d["end"], r["submitted"], r["end"]) > 0 for r in llm):
            continue
        beside = any(_overlap(d["start"], d["end"], s["start"], s["end"]) > 0 for s in st)
        out["decode_ms_beside_smart_turn" if beside else "decode_ms_alone"].append(1000 * (d["end"] - d["start"]))
    for r in llm:
        if r["lane"] != "interactive" or not r.get("vllm_first_token") or not r.get("vllm_scheduled"):
            continue
        a, b = r["vllm_scheduled"], r["vllm_first_token"]
        beside = any(_overlap(a, b, s["start"], s["end"]) > 0 for s in st)
        new = max(1, r["prompt_tokens"] - r["cached_tokens"])
        key = "beside_smart_turn" if beside else "alone"
        out[f"prefill_ms_{key}"].append(1000 * (b - a))
        out[f"prefill_ms_per_new_token_{key}"].append(1000 * (b - a) / new)
    return {k: summarise([x / 1000 for x in v]) for k, v in out.items()}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("--report", "-h", "--help"):
        p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                    epilog=JSON_EPILOG)
        p.add_argument("--report", type=Path, required=True,
                       help="a trace.jsonl: print each interactive TTFT with what overlapped it, and write "
                            "TRACE.report.json (without --report: `voicebot` with the same arguments, traced)")
        return report(p.parse_args().report)
    target = os.environ.get("TRACE_OUT")
    if target:
        install(target)
    from voicebot.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
