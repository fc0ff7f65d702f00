"""What one frontend costs the host per caller: cores per 100 callers, and the frontend's
own delay per turn, with the ASR, LLM and TTS replaced by fixed-latency fakes.

    python benchmarks/frontend_cost.py --sessions 10 25 50 --out OUT [--finals-only] \
        [--asr-ms 150 --llm-ttft-ms 100 --llm-tokens-per-s 50 --tts-ms 80]

The frontend is the real server (``voicebot serve`` through ``pipeline_gpu.py``'s ``serve``
mode: native WS, the real Silero VAD and Smart Turn, the real sessions, playout and
pacing) with ``asr.backend``, ``llm.backend`` and ``tts.backend`` all ``remote``. What it
talks to is this file's ``fakes`` process, speaking each service's real wire, so the
frontend runs unmodified:

- ASR: the real ``voicebot asr-serve`` service code (``AsrService``) over an engine whose
  decoder answers a fixed transcript after ``--asr-ms`` (partials and finals alike);
- LLM: vLLM's OpenAI ``/v1/completions`` stream: after ``--llm-ttft-ms`` a fixed English
  reply, one real token id per chunk at ``--llm-tokens-per-s``;
- TTS: the real ``voicebot tts-serve`` service code (``TtsService``) over an engine that
  yields, ``--tts-ms`` after each clause, a tone as long as the clause takes to say.

The callers are the probe (``pipeline_gpu.py run``: real clips in real time, 20 ms frames).
Per level it reports the frontend process's CPU per call-second as **cores per 100
callers** (and its loop thread's), and per turn the **frontend overhead**: what the
pipeline's stages took beyond the fakes' own latencies (ASR final beyond ``--asr-ms`` when
it was decoded, LLM time to first token beyond ``--llm-ttft-ms``, TTS first audio beyond
``--tts-ms``), plus the gap between the probe's and the server's voice to voice (the loop's
lateness in sending and receiving). The fakes run in a process of their own; their CPU is
not the frontend's. ``--py-spy`` records the frontend's stacks during the last level
(py-spy on PATH) and prints the top functions by own time.

Output: ``OUT/frontend_cost.json`` (one row per level) beside ``pipeline_gpu.py``'s own
``OUT/pipeline.json`` and ``OUT/level_N.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_util import JSON_EPILOG, results_of, write_result  # benchmarks/, beside this file

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
TRANSCRIPT = "Hi, could you tell me when my order will arrive and whether I can still change the address?"
REPLY = ("Sure, I can help with that. Your order shipped this morning and it should arrive on Thursday "
         "before noon. Is there anything else I can do for you today?")
WORDS_PER_S = 2.6  # a steady speaking rate: the fake TTS's clause length


# ============================================================== fakes: the three services
class FixedDecoder:
    """A :class:`~voicebot.engines.asr.jobs.Decoder`: the fixed transcript after ``delay_s``."""

    name = "fixed-asr"
    samples = False

    def __init__(self, delay_s: float, slots: int) -> None:
        self.delay_s, self.slots = delay_s, slots

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def abandon(self, job: Any) -> None: ...

    async def decode(self, job: Any) -> tuple[str, float]:
        await asyncio.sleep(self.delay_s)
        prefix = job.prefix.split()
        return " ".join(TRANSCRIPT.split()[len(prefix):]), self.delay_s


class FixedTts:
    """A TTS engine: per clause, after ``delay_s``, a tone as long as the clause takes to say."""

    sample_rate = 24_000
    queue_depth = 0
    failure_streak = 0
    last_error = None

    def __init__(self, delay_s: float) -> None:
        import numpy as np

        self.delay_s = delay_s
        t = np.arange(self.sample_rate * 30) / self.sample_rate
        self._tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)  # loud: the probe hears it

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def voices(self) -> list[str]:
        return ["fixed"]

    async def synthesize(self, text: str, *, voice: str | None = None, speed: float | None = None,
                         ahead_s: float = 0.0) -> Any:
        await asyncio.sleep(self.delay_s)
        seconds = max(0.3, len(text.split()) / WORDS_PER_S)
        yield self._tone[: int(seconds * self.sample_rate)].copy()


def llm_app(tokenizer_dir: str, ttft_s: float, tokens_per_s: float) -> Any:
    """vLLM's OpenAI server as far as the remote LLM backend uses it: /v1/models, /health and
    streamed /v1/completions (text and token ids per chunk, usage, [DONE])."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.encode(REPLY, add_special_tokens=False)
    pieces = [(tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])):], i) for i in range(len(ids))]

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"data": [{"id": "fake-llm", "object": "model"}]})

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({})

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        prompt = len(body.get("prompt") or [])
        limit = int(body.get("max_tokens") or len(ids))

        async def stream() -> Any:
            await asyncio.sleep(ttft_s)
            start = time.monotonic()
            n = min(limit, len(ids))
            for k, (text, i) in enumerate(pieces[:n]):
                await asyncio.sleep(max(0.0, start + k / tokens_per_s - time.monotonic()))
                reason = ("stop" if n == len(ids) else "length") if k == n - 1 else None
                chunk = {"choices": [{"index": 0, "text": text, "token_ids": [ids[i]], "finish_reason": reason}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/health", health),
                             Route("/v1/completions", completions, methods=["POST"])])


async def fakes_main(args: argparse.Namespace) -> None:
    """Serve the three fakes until SIGTERM; print their URLs as one JSON line."""
    import uvicorn

    from voicebot.config import AsrConfig
    from voicebot.engines.asr.engine import AsrEngine
    from voicebot.services import asr_service, tts_service

    asr_engine = AsrEngine(AsrConfig(queue_size=4096), "fixed", decoder=FixedDecoder(args.asr_ms / 1000, 1024))
    await asr_engine.start()
    asr = asr_service.AsrService(asr_engine, slots=1024, queue_size=4096, backend="fixed")
    asr.start()
    tts = tts_service.TtsService(FixedTts(args.tts_ms / 1000), engine_name="fixed")  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(llm_app(args.tokenizer, args.llm_ttft_ms / 1000, args.llm_tokens_per_s),
                                           host="127.0.0.1", port=args.llm_port, log_level="warning",
                                           access_log=False))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with asr_service.listen(asr, "127.0.0.1", 0) as a, tts_service.listen(tts, "127.0.0.1", 0) as t:
        llm_task = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110 (uvicorn has no event for it)
            await asyncio.sleep(0.05)
        urls = {"asr": f"ws://127.0.0.1:{next(iter(a.sockets)).getsockname()[1]}",
                "tts": f"ws://127.0.0.1:{next(iter(t.sockets)).getsockname()[1]}",
                "llm": f"http://127.0.0.1:{args.llm_port}"}
        print(json.dumps(urls), flush=True)
        await stop.wait()
        server.should_exit = True
        await llm_task
    await asr.aclose()
    await tts.aclose()
    await asr_engine.aclose()


# ============================================================== run: fakes + pipeline_gpu.py
def start_fakes(args: argparse.Namespace, out: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    from serverproc import free_port

    cmd = [sys.executable, str(Path(__file__).resolve()), "fakes", "--tokenizer", args.tokenizer,
           "--llm-port", str(free_port()), "--asr-ms", str(args.asr_ms), "--tts-ms", str(args.tts_ms),
           "--llm-ttft-ms", str(args.llm_ttft_ms), "--llm-tokens-per-s", str(args.llm_tokens_per_s)]
    log = (out / "fakes.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the fakes did not start: {(out / 'fakes.log').read_text()[-3000:]}")
    return proc, json.loads(line)


def overhead_of(turn: dict[str, Any], args: argparse.Namespace) -> dict[str, float] | None:
    """The frontend's own part of a turn's delay (see the module docstring), in ms."""
    t = turn.get("timings") or {}
    need = ("asr_final_ms", "llm_ttft_ms", "tts_first_audio_ms", "voice_to_voice_ms")
    if turn.get("status") != "ok" or turn.get("voice_to_voice_ms") is None or any(t.get(k) is None for k in need):
        return None
    # A final taken from a partial that saw the end of speech was not decoded: nothing to subtract.
    asr = t["asr_final_ms"] - (args.asr_ms if t["asr_final_ms"] >= args.asr_ms else 0.0)
    stages = {
        "asr": asr,
        "llm": t["llm_ttft_ms"] - args.llm_ttft_ms,
        "tts": t["tts_first_audio_ms"] - args.tts_ms,
        "wire": turn["voice_to_voice_ms"] - t["voice_to_voice_ms"],
    }
    stages["total"] = sum(stages.values())
    return stages


def spy_top(raw: Path, n: int = 25) -> list[tuple[str, float]]:
    """py-spy's raw (collapsed) stacks -> the functions with the most own time, as % of samples."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        own[stack.split(";")[-1]] += int(count)
    return [(frame, round(100 * c / total, 2)) for frame, c in own.most_common(n)] if total else []


def run_main(args: argparse.Namespace) -> int:
    from voicebot.probe.measure import percentiles

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fakes, urls = start_fakes(args, out)
    rows: list[dict[str, Any]] = []
    try:
        cmd = [sys.executable, str(HERE / "pipeline_gpu.py"), "run", "--config", args.config, "--out", str(out),
               "--remote-llm", "--llm-url", urls["llm"], "--remote-asr", "--asr-url", urls["asr"],
               "--remote-tts", "--tts-url", urls["tts"], "--no-script-replies", "--llm-max-tokens", "0",
               "--llm-dir", args.tokenizer, "--audio", *args.audio, "--sessions", *map(str, args.sessions),
               "--turns", str(args.turns), "--ramp-s", str(args.ramp_s), "--keep-going",
               "--start-timeout-s", "120", "--asr-frontend-concurrency", "1024",
               "--set", f"llm.model={args.tokenizer}", "--set", "server.transports=[native]",
               "--set", f"asr.partials={'false' if args.finals_only else 'true'}",
               "--set", "vad.turn_detector=smart_turn", "--set", "server.omp_threads=1",
               "--set", "models.offline=true"]
        if args.server_workers:
            cmd += ["--server-workers", str(args.server_workers)]
        for item in args.set:
            cmd += ["--set", item]
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        spy = None
        if args.py_spy:
            if shutil.which("py-spy") is None:
                raise SystemExit("--py-spy: py-spy is not on PATH (pip install py-spy)")
            spy = asyncio.run(_spy_last_level(cmd, env, out, args))
        else:
            subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    finally:
        fakes.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            fakes.wait(15)
        if fakes.poll() is None:
            fakes.kill()
    summary = results_of(json.loads((out / "pipeline.json").read_text()))
    for level in sorted(summary["levels"], key=lambda lv: lv["sessions"]):
        n = level["sessions"]
        turns = results_of(json.loads((out / f"level_{n}.json").read_text()))["turns"]
        over = [o for o in (overhead_of(t, args) for t in turns) if o is not None]
        server = level.get("server") or {}
        cores = server.get("process_cores")
        row = {
            "sessions": n,
            "cores_per_100_callers": round(100 * cores / n, 3) if cores is not None else None,
            "loop_cores_per_100_callers": (round(100 * server["loop_thread_cores"] / n, 3)
                                           if server.get("loop_thread_cores") is not None else None),
            "process_cores": cores,
            # with --server-workers: each worker's cores (how evenly the calls spread)
            "worker_cores": [f.get("process_cores") for f in server.get("frontends", [])] or None,
            "loop_lag_ms": server.get("lag_ms"),
            "overhead_ms": {k: percentiles([o[k] for o in over]) for k in ("total", "asr", "llm", "tts", "wire")},
            "v2v_ms": level["v2v_ms"],
            "turns": level["turns"],
            "dropped_sessions": level["dropped_sessions"],
            "fakes_cores": {"asr": (level.get("asr_service") or {}).get("cores"),
                            "tts": (level.get("tts_service") or {}).get("cores")},
        }
        rows.append(row)
        o = row["overhead_ms"]["total"]
        print(f"N={n:4d}  frontend {cores} cores = {row['cores_per_100_callers']} per 100 callers "
              f"(loop {row['loop_cores_per_100_callers']})  overhead p50/p95 {o.get('p50')}/{o.get('p95')} ms  "
              f"v2v p50/p95 {level['v2v_ms']['p50']}/{level['v2v_ms']['p95']}  "
              f"dropped {level['dropped_sessions']}"
              + (f"  workers' cores {row['worker_cores']}" if row["worker_cores"] else ""), flush=True)
    result: dict[str, Any] = {"levels": rows, "fakes": {"asr_ms": args.asr_ms, "llm_ttft_ms": args.llm_ttft_ms,
                                                        "llm_tokens_per_s": args.llm_tokens_per_s,
                                                        "tts_ms": args.tts_ms},
                              "finals_only": args.finals_only}
    if spy is not None:
        result["py_spy_top_own"] = spy
        print("py-spy, the frontend during the last level: own time, % of samples")
        for frame, pct in spy:
            print(f"  {pct:6.2f}  {frame}")
    write_result(out / "frontend_cost.json", "frontend_cost", args, result)
    return 0


async def _spy_last_level(cmd: list[str], env: dict[str, str], out: Path, args: argparse.Namespace) -> list[tuple[str, float]]:
    """Run the levels; when the last one starts, py-spy the frontend (its pid in OUT/server_0.pid)."""
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    levels = sorted(args.sessions)
    # pipeline_gpu.py prints a line when the warm-up calls end and one per level as it ends
    trigger = "warm-up calls" if len(levels) == 1 else f"N={levels[-2]:4d}"
    raw = out / "py-spy.raw"
    spy: asyncio.subprocess.Process | None = None
    async for line in proc.stdout:
        text = line.decode(errors="replace")
        print(text, end="", flush=True)
        if spy is None and text.startswith(trigger):
            pid = (out / "server_0.pid").read_text().split()[0]
            spy = await asyncio.create_subprocess_exec(
                "py-spy", "record", "-p", pid, "-d", str(int(args.spy_s)), "-r", "100", "--format", "raw",
                "-o", str(raw), "--nonblocking", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if await proc.wait():
        raise SystemExit(f"pipeline_gpu.py run failed ({proc.returncode})")
    if spy is None:
        return []
    await asyncio.wait_for(spy.wait(), args.spy_s + 60)
    return spy_top(raw) if raw.exists() else []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=JSON_EPILOG)
    sub = p.add_subparsers(dest="command")
    f = sub.add_parser("fakes", help="(internal) serve the fake ASR, LLM and TTS")
    f.add_argument("--llm-port", type=int, required=True)
    for q in (p, f):
        q.add_argument("--tokenizer", default="bundle:qwen3-tokenizer",
                       help="a tokenizer (directory or bundle:NAME): the frontend's llm.model, the fake LLM's ids")
        q.add_argument("--asr-ms", type=float, default=150.0, help="each decode's latency at the fake ASR")
        q.add_argument("--llm-ttft-ms", type=float, default=100.0, help="the fake LLM's time to first token")
        q.add_argument("--llm-tokens-per-s", type=float, default=50.0, help="the fake LLM's tokens per second")
        q.add_argument("--tts-ms", type=float, default=80.0, help="the fake TTS's latency to each clause's audio")
    p.add_argument("--out", help="output folder")
    p.add_argument("--config", default="configs/gpu-asr-service.yaml", help="the frontend's config (the GPU layout's)")
    p.add_argument("--set", action="append", default=[], help="more frontend overrides KEY=VALUE")
    p.add_argument("--sessions", type=int, nargs="+", default=[10, 25, 50])
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--ramp-s", type=float, default=6.0, help="session starts spread over this long")
    p.add_argument("--audio", nargs="+", help="16 kHz clips the callers say (default: the test speech)")
    p.add_argument("--finals-only", action="store_true", help="asr.partials=false in the frontend")
    p.add_argument("--server-workers", type=int, default=0,
                   help="the frontend as one server of K workers on one port (server.workers)")
    p.add_argument("--py-spy", action="store_true", help="record the frontend's stacks during the last level")
    p.add_argument("--spy-s", type=float, default=20.0)
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.command == "fakes":
        asyncio.run(fakes_main(args))
        return 0
    if not args.out:
        build_parser().error("--out is required")
    from voicebot.config import ModelsConfig
    from voicebot.provision import resolve_model

    args.tokenizer = resolve_model(args.tokenizer, ModelsConfig())
    if not args.audio:
        sys.path.insert(0, str(ROOT / "tests"))
        from speech import load_clips  # the test speech: six utterances, fetched once

        args.audio = [str(c.path) for c in load_clips(ModelsConfig())]
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
