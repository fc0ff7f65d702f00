"""TTS at scale on a GPU: Kokoro-82M batched across sessions (random weights, real shape).

    python benchmarks/gpu_kokoro.py --device cuda --sessions 64 128 256 512 1024 --json OUT

The workload of ``benchmarks/gpu_tts.py`` (Piper on CPU cores), on one Kokoro model:
each simulated session speaks a reply clause by clause (a short first clause, then
sentences), plays it out in real time, then listens for ``--listen-s`` before the next
reply. Per reply: first audio (the first clause's synthesis, queueing included) and
stalls, i.e. playback time lost waiting for the next clause (a stream is real-time if it
never stalls). As there, a session asks for its next clause when the previous one's audio
arrives (one clause of look-ahead).

Engine: ``voicebot/engines/tts/kokoro_batch.py`` (``KokoroBatcher``: one bounded queue of
clauses from every session, earliest deadline first; up to ``--max-batch`` clauses per
forward; ``--workers`` forwards at once, each on its own CUDA stream) over
``voicebot/engines/tts/kokoro_model.py`` (the ``kokoro`` package's ``KModel`` modules, run
batched: padded phonemes, then the vocoder in groups of similar length with per-utterance
instance norms). Modes:

- ``batched``: ``--max-batch`` clauses per forward, ``--workers`` forwards at once;
- ``streams``: batch 1, ``--stream-workers`` forwards at once, each on its own CUDA
  stream (what ``KModel`` allows without batching), at ``--stream-sessions``.

**Random weights of the real shape** (hexgrad/Kokoro-82M config.json, 81.8 M parameters;
weights cannot be downloaded on the GPU machines). Speed does not depend on the weights'
values, except through the predicted durations, which random weights get wrong (~25
frames per phoneme): durations are forced instead, 2-3 frames (50-75 ms) per phoneme,
mean 2.5, and 1.07 phonemes per character of the clause, as the real model does on these
replies (tests/kokoro_weights.py's int8 weights: 2.53 frames per phoneme, 14.9 characters
per second), so input and audio lengths are those of real speech. Phoneme ids are random.

Variants (``--variants``, each on its own model of the same seed, all in one run):
``reference`` (the package's forwards with kokoro_model's masks: what main ran),
``eager`` (the fused chains, ``kokoro_fused``), ``compile`` (each chain one
``torch.compile``-d kernel: ``tts.kokoro_compile``), ``graphs`` (the decode over
(rows, frames) buckets, each captured as a CUDA graph: ``tts.kokoro_cuda_graphs``) and
``compile+graphs``. With ``--count`` each variant times ``decode()`` per vocoder group of
one batch (median of ``--count-repeats`` after ``--decode-warmup`` runs, which also compile
and capture), its GPU kernel time (one profiled run, ``--kernel-time``) and seconds of audio
per second; without, each variant runs the ``--sessions`` scenarios. ``--dtypes`` runs each
variant at each decode precision (``tts.kokoro_dtype``), named ``VARIANT@DTYPE`` past float32.

    python benchmarks/gpu_kokoro.py --device cuda --variants reference eager compile graphs compile+graphs \
        --count 1 8 32 64 --count-repeats 5 --kernel-time --json OUT

Prints a table and writes JSON (``--json``, rewritten after every scenario).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench_util import JSON_EPILOG, bare_engines_package, run_with_deadline, write_result  # noqa: E402  (same folder)

bare_engines_package()

from tts_workload import FIRST, FIRST_AUDIO, REST, Stats, caller, pct, scenario_table  # noqa: E402  (same folder)

log = logging.getLogger("gpu_kokoro")

N_TOKEN = 178


def phonemes(text: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """Stand-in phoneme ids and forced durations (frames of 25 ms) of real English speech:
    the real model (int8 weights, af_heart, espeak G2P) gives these replies 1.07 phonemes
    per character and 2.53 frames per phoneme (14.9 characters per second)."""
    n = max(1, round(len(text) * 1.07))
    return [rng.randrange(1, N_TOKEN) for _ in range(n)], [rng.choice((2, 2, 3, 3)) for _ in range(n)]


class GpuSampler:
    """nvidia-smi every ``period_s`` in a thread: GPU utilisation and memory while a scenario runs."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.util: list[float] = []
        self.mem_mib: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=5, check=True).stdout.splitlines()[0]
            except (OSError, subprocess.SubprocessError, IndexError):
                return
            util, mem = (float(x) for x in out.split(","))
            self.util.append(util)
            self.mem_mib.append(mem)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self) -> dict[str, Any]:
        if not self.util:
            return {}
        return {"gpu_util_mean": round(sum(self.util) / len(self.util), 1), "gpu_util_max": max(self.util),
                "gpu_mem_max_mib": max(self.mem_mib), "gpu_samples": len(self.util)}


async def session(eng: Any, args: argparse.Namespace, st: Stats, t_start: float, t_end: float,
                  rng: random.Random, style: Any) -> None:
    loop = asyncio.get_running_loop()

    async def speak(clause: str, ahead: float | None) -> AsyncIterator[Any]:
        ids, dur = phonemes(clause, rng)
        # Earliest deadline first: the first clause is due now, a later one when
        # playback reaches it (fifo: every clause is due when asked for).
        due = loop.time() + ahead if args.policy == "edf" and ahead is not None else None
        yield await eng.synthesize(ids, style, deadline=due, durations=dur)

    await caller(speak, 24_000, args, st, t_start, t_end, rng)


def batch_frames(args: argparse.Namespace) -> int | None:
    """The batcher's bound in frames of speech (``tts.max_batch_s`` as the engine turns it)."""
    from voicebot.engines.tts.kokoro_batch import FRAMES_PER_S

    return None if args.max_batch_s is None else round(args.max_batch_s * FRAMES_PER_S)


async def scenario(eng: Any, args: argparse.Namespace, n: int, styles: Any) -> dict[str, Any]:
    st = Stats()
    t_start = time.monotonic()
    t_end = t_start + args.duration_s
    base = random.Random(f"{args.seed}-{n}")
    b0 = (eng.stats.batches, eng.stats.clauses, eng.stats.busy_s, eng.stats.sizes.copy())
    cpu0 = os.times()
    with GpuSampler() as gpu:
        tasks = [asyncio.create_task(session(eng, args, st, t_start, t_end, random.Random(base.random()),
                                             styles[i % len(styles)])) for i in range(n)]
        _, late = await asyncio.wait(tasks, timeout=args.duration_s + 60)
        for t in late:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    cpu1 = os.times()
    wall = time.monotonic() - t_start
    sizes = sorted((eng.stats.sizes - b0[3]).elements())  # this scenario's forwards, by clauses
    batches = eng.stats.batches - b0[0]
    return st.report(
        n, wall, cpu1.user - cpu0.user + cpu1.system - cpu0.system, args.stall_tolerance_s, len(late),
        batches=batches,
        batch_mean=round((eng.stats.clauses - b0[1]) / batches, 1) if batches else None,
        batch_p95=round(pct([float(s) for s in sizes], 95) or 0, 1),
        batch_max=max(sizes, default=0),
        # Forward wall time summed over workers, over the scenario's wall: 1.0 = one worker always busy.
        forward_busy=round((eng.stats.busy_s - b0[2]) / wall, 3),
        **gpu.summary(),
    )


def dump(args: argparse.Namespace, report: dict[str, Any]) -> None:
    write_result(args.json, "gpu_kokoro", args, report)


async def warm_up(eng: Any, styles: Any, max_batch: int) -> float:
    """Every batch size class once (CUDA kernels, cuDNN LSTM plans, the allocator's pools)."""
    rng = random.Random(1)
    t0 = time.perf_counter()
    for size in sorted({min(s, max_batch) for s in (1, 2, 8, max(1, max_batch // 4), max_batch)}):
        jobs = []
        for i in range(size):
            ids, dur = phonemes(rng.choice(FIRST + REST), rng)
            jobs.append(eng.synthesize(ids, styles[i % len(styles)], durations=dur))
        await asyncio.gather(*jobs)
    await eng.idle()
    return time.perf_counter() - t0


def reply_batch(n: int, styles: Any, device: Any) -> tuple[list[list[int]], list[list[int]], Any]:
    """``n`` clauses of replies (half first clauses, half sentences; the same for a given
    ``n``): their phoneme ids, forced durations and styles on ``device``."""
    import torch

    rng = random.Random(3)
    texts = [rng.choice(FIRST) if i % 2 == 0 else rng.choice(REST) for i in range(n)]
    lens = [phonemes(t, rng) for t in texts]
    st = torch.stack([styles[i % len(styles)] for i in range(n)]).to(device)
    return [x[0] for x in lens], [x[1] for x in lens], st


def profile_forward(model: Any, n: int, styles: Any, out: Path | None) -> dict[str, Any]:
    """One batched forward of ``n`` clauses (half first clauses, half sentences), warmed up, then:
    stage wall times with a device sync after each stage, and a torch.profiler table of the
    same forward (top ops by self CPU and by self CUDA time) written to ``out``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from voicebot.engines.tts import kokoro_model as km
    from voicebot.engines.tts.kokoro_batch import MAX_FRAMES

    cuda = str(model.device).startswith("cuda")
    ids, durs, st = reply_batch(n, styles, model.device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def forward(stages: dict[str, float] | None) -> None:
        t0 = time.perf_counter()
        enc = km.encode(model, ids, st, [1.0] * n, durs)
        sync()
        t1 = time.perf_counter()
        groups = km.frame_groups([e.frames for e in enc], 0.25, MAX_FRAMES)
        for g in groups:
            audio = km.decode(model, [enc[i] for i in g])
            torch.cat(audio).cpu()
        sync()
        if stages is not None:
            stages.update(encode_ms=round((t1 - t0) * 1000, 1), decode_ms=round((time.perf_counter() - t1) * 1000, 1),
                          groups=len(groups))

    with torch.inference_mode():
        forward(None)
        stages: dict[str, float] = {}
        forward(stages)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            forward(None)
    avg = prof.key_averages()
    tables = [avg.table(sort_by="self_cpu_time_total", row_limit=25)]
    if cuda:
        tables.append(avg.table(sort_by="self_cuda_time_total", row_limit=25))
    if out is not None:
        out.write_text("\n\n".join(tables))
    top = sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    res = {"clauses": n, **stages, "events": len(prof.events()),
           "top_self_cpu_ms": {e.key: round(e.self_cpu_time_total / 1000, 1) for e in top}}
    print(f"[gpu_kokoro] profile of one forward of {n} clauses: {stages}, {res['events']} profiler events", flush=True)
    print(tables[-1], flush=True)
    return res


def count_forward(model: Any, sizes: list[int], styles: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """For each batch size: what one batched forward (``torch_runner``: encode, then decode per
    vocoder group, audio to the host) dispatches (``voicebot/engines/tts/op_count.py``: device
    kernels, view ops, host ops, host-device syncs and where; on a CPU run only: the counter
    models the device there), then its wall time (median of
    ``--count-repeats``, without the counter, after the counted one; 0: no timing). ``--count-tiny``: clauses of 4 phonemes of 2
    frames, so that the time is the fixed per-forward cost rather than compute."""
    import torch

    from voicebot.engines.tts import kokoro_model as km
    from voicebot.engines.tts.kokoro_batch import MAX_FRAMES, Clause, torch_runner
    from voicebot.engines.tts.op_count import OpCounter

    class Done:  # a clause's future, for a runner called directly
        def cancelled(self) -> bool:
            return False

    cuda = str(model.device).startswith("cuda")
    runner = torch_runner(model, max_pad=args.max_pad, max_frames=args.max_frames or MAX_FRAMES,
                          overlap=args.overlap)
    rows = []
    for n in sizes:
        rng = random.Random(3)
        batch = []
        for i in range(n):
            if args.count_tiny:
                ids, dur = [rng.randrange(1, N_TOKEN) for _ in range(4)], [2] * 4
            else:
                ids, dur = phonemes(rng.choice(FIRST) if i % 2 == 0 else rng.choice(REST), rng)
            batch.append(Clause(ids=ids, style=styles[i % len(styles)], speed=1.0, deadline=0.0,
                                future=Done(), durations=dur))  # type: ignore[arg-type]
        groups = len(km.frame_groups([sum(c.durations or ()) + 2 for c in batch], args.max_pad,
                                     args.max_frames or MAX_FRAMES))
        samples: list[int] = []

        def forward(batch: list[Any] = batch, samples: list[int] = samples) -> None:
            runner(batch, lambda cs, audio: samples.extend(a.shape[0] for a in audio))

        row: dict[str, Any] = {"clauses": n, "groups": groups}
        if not cuda:  # the counter models a device on a CPU run (op_count.MARK): CPU only
            with OpCounter(model) as oc:
                forward()
            row.update(oc.counts.summary())
        elif args.count_repeats:
            forward()  # warm-up
        row["audio_s"] = round(sum(samples) / 24_000, 2)
        times = []
        for _ in range(args.count_repeats):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward()
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1000)
        row["forward_ms_median"] = round(sorted(times)[len(times) // 2], 1) if times else None
        row["forward_ms"] = [round(t, 1) for t in times]
        rows.append(row)
        print(f"[gpu_kokoro] count {n} clauses ({groups} groups, {row['audio_s']} s audio): "
              f"{row.get('device_kernels')} device kernels, {row.get('device_views')} views, "
              f"{row.get('host_ops')} host ops, {row.get('syncs')} syncs {row.get('syncs_by_kind')}, "
              f"forward {row['forward_ms_median']} ms", flush=True)
    return rows


VARIANTS = ("reference", "eager", "compile", "graphs", "compile+graphs")


def build_variant(variant: str, device: str, seed: int, dtype: str = "float32") -> tuple[Any, Any]:
    """The model and the decode function of ``variant`` (see the module docstring)."""
    import torch

    from voicebot.engines.tts import kokoro_model as km
    from voicebot.engines.tts.kokoro_graphs import BucketedDecoder

    torch.manual_seed(seed)
    model = km.build_model(km.random_config(), device=device, fused=variant != "reference",
                           compile=variant.startswith("compile"), dtype=dtype)
    if variant.endswith("graphs"):
        return model, BucketedDecoder(model, cuda_graphs=True)
    return model, None


# What a decode's kernels are, by name (cuDNN's and CUTLASS's convolutions, GEMMs, Inductor's
# fused Triton kernels, the FFT of the iSTFT, the rest): where a cheaper vocoder must save.
KERNEL_KINDS = (
    ("conv", ("conv", "fprop", "dgrad", "implicit_gemm", "winograd", "nchwtonhwc", "nhwctonchw")),
    ("gemm", ("gemm", "gemv", "cublas")),
    ("fft", ("fft", "stft")),
    ("triton", ("triton",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")


def kernel_breakdown(kernels: list[tuple[str, float, int]], top: int = 12) -> dict[str, Any]:
    """``kernels``: (name, device ms, calls) of one profiled run. Device ms by kind (a share
    of the whole each) and the ``top`` kernels by time, names cut to 90 characters."""
    total = sum(ms for _, ms, _ in kernels) or 1.0
    kinds: dict[str, float] = {}
    for name, ms, _ in kernels:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    by_time = sorted(kinds.items(), key=lambda kv: -kv[1])
    ranked = sorted(kernels, key=lambda k: -k[1])[:top]
    return {"kinds_ms": {k: round(v, 2) for k, v in by_time},
            "kinds_pct": {k: round(100 * v / total, 1) for k, v in by_time},
            "top": [{"name": n[:90], "ms": round(ms, 2), "calls": c, "kind": kernel_kind(n)} for n, ms, c in ranked]}


def decode_times(model: Any, graphs: Any, sizes: list[int], styles: Any, args: argparse.Namespace,
                 variant: str) -> list[dict[str, Any]]:
    """Per batch size: ``decode()`` of every vocoder group of one encoded batch of replies
    (half first clauses, half sentences), audio to the host: wall ms (median), GPU kernel ms
    (``--kernel-time``: the profiler's device time of one run), audio seconds per second."""
    import torch

    from voicebot.engines.tts import kokoro_model as km
    from voicebot.engines.tts.kokoro_batch import MAX_FRAMES

    cuda = str(model.device).startswith("cuda")
    decode = graphs.decode if graphs is not None else (lambda items: km.decode(model, items))
    encode = bucketed_encode(model, graphs) or functools.partial(km.encode, model)
    rows = []
    for n in sizes:
        ids, durs, st = reply_batch(n, styles, model.device)
        row: dict[str, Any] = {"variant": variant, "clauses": n}
        try:
            with torch.inference_mode():
                row.update(encode_times(encode, ids, st, durs, args, cuda))
                enc = km.encode(model, ids, st, [1.0] * n, durs)
                groups = km.frame_groups([e.frames for e in enc], args.max_pad, args.max_frames or MAX_FRAMES)

                def run(enc: list[Any] = enc, groups: list[list[int]] = groups) -> None:
                    for g in groups:
                        torch.cat(decode([enc[i] for i in g])).cpu()
                    if cuda:
                        torch.cuda.synchronize()

                t0 = time.perf_counter()
                for _ in range(args.decode_warmup):
                    run()
                row["warmup_s"] = round(time.perf_counter() - t0, 2)
                times = []
                for _ in range(args.count_repeats):
                    t0 = time.perf_counter()
                    run()
                    times.append((time.perf_counter() - t0) * 1000)
                if args.kernel_time and cuda:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        run()
                    # The kernels' own rows only: an op's row carries its kernels' time again.
                    kernels = [(e.key, e.self_device_time_total / 1000, e.count) for e in prof.key_averages()
                               if e.device_type == torch.autograd.DeviceType.CUDA]
                    row["kernel_ms"] = round(sum(ms for _, ms, _ in kernels), 1)
                    row["kernels"] = kernel_breakdown(kernels)
        except Exception as exc:  # noqa: BLE001  (one variant failing must not lose the others)
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
            print(f"[gpu_kokoro] {variant} {n} clauses: FAILED {row['error']}", flush=True)
            continue
        audio_s = sum(e.frames for e in enc) * km.SAMPLES_PER_FRAME / km.SAMPLE_RATE
        med = sorted(times)[len(times) // 2] if times else None
        row.update(groups=len(groups), audio_s=round(audio_s, 2), decode_ms=round(med, 1) if med else None,
                   decode_ms_all=[round(t, 1) for t in times],
                   audio_s_per_s=round(audio_s / (med / 1000), 1) if med else None)
        if graphs is not None:
            row.update(captures=graphs.captures, eager_groups=graphs.eager_calls)
        rows.append(row)
        print(f"[gpu_kokoro] {variant} {n} clauses: encode {row.get('encode_ms', '-')} ms "
              f"(launched in {row.get('encode_launch_ms', '-')} ms)", flush=True)
        print(f"[gpu_kokoro] {variant} {n} clauses ({len(groups)} groups, {row['audio_s']} s audio): decode "
              f"{row['decode_ms']} ms, kernels {row.get('kernel_ms', '-')} ms, {row['audio_s_per_s']} s audio/s, "
              f"warm-up {row['warmup_s']} s", flush=True)
    return rows


def bucketed_encode(model: Any, graphs: Any) -> Any:
    """A graph variant's encode over (rows, phonemes) buckets, as ``tts.kokoro_encode_graphs``
    runs it beside the bucketed decode; None for the other variants (``kokoro_model.encode``)."""
    if graphs is None:
        return None
    from voicebot.engines.tts.kokoro_graphs import BucketedEncoder

    return BucketedEncoder(model, cuda_graphs=graphs.cuda_graphs).encode


def encode_times(encode: Any, ids: list[Any], styles: Any, durs: list[Any], args: argparse.Namespace,
                 cuda: bool) -> dict[str, Any]:
    """One batch's encode (forced durations: no sync of its own), median of
    ``--count-repeats`` after ``--decode-warmup`` runs: ``encode_launch_ms`` until it returns
    (the host's launches), ``encode_ms`` until the GPU has run it; none with no repeats."""
    import torch

    if args.count_repeats < 1:
        return {}
    n = len(ids)
    for _ in range(args.decode_warmup):
        encode(ids, styles, [1.0] * n, durs)
    if cuda:
        torch.cuda.synchronize()
    launch, done = [], []
    for _ in range(args.count_repeats):
        t0 = time.perf_counter()
        encode(ids, styles, [1.0] * n, durs)
        launch.append((time.perf_counter() - t0) * 1000)
        if cuda:
            torch.cuda.synchronize()
        done.append((time.perf_counter() - t0) * 1000)
    return {"encode_launch_ms": round(sorted(launch)[len(launch) // 2], 1),
            "encode_ms": round(sorted(done)[len(done) // 2], 1)}


async def run_variants(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    """Every ``--variants`` in turn: ``--count`` decode times, else the ``--sessions`` scenarios."""
    import torch

    from voicebot.engines.tts.kokoro_batch import MAX_FRAMES, KokoroBatcher, torch_runner

    styles = torch.randn(args.voices, 256, generator=torch.Generator().manual_seed(args.seed)) * 0.15
    report.update(variants=args.variants, decode=[], scenarios=[])
    named = [(v, dt, v if dt == "float32" else f"{v}@{dt}") for v in args.variants for dt in args.dtypes]
    for kind, dtype, variant in named:
        try:
            model, graphs = build_variant(kind, args.device, args.seed, dtype)
        except Exception as exc:  # noqa: BLE001  (e.g. graphs on a CPU: recorded, the next variant runs)
            report.setdefault("variant_errors", {})[variant] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"[gpu_kokoro] {variant}: cannot build: {exc}", flush=True)
            continue
        if args.count:
            report["decode"] += decode_times(model, graphs, args.count, styles, args, variant)
            dump(args, report)
        else:
            runner = torch_runner(model, max_pad=args.max_pad, max_frames=args.max_frames or MAX_FRAMES,
                                  overlap=args.overlap, decoder=None if graphs is None else graphs.decode,
                                  encoder=bucketed_encode(model, graphs))
            eng = KokoroBatcher(runner, max_batch=args.max_batch, queue_size=args.queue_size, workers=args.workers[0],
                                max_frames=batch_frames(args))
            eng.start()
            try:
                warm = await warm_up(eng, styles, args.max_batch)
                print(f"[gpu_kokoro] {variant}: warm-up {warm:.1f} s", flush=True)
                for n in args.sessions:
                    await eng.idle()
                    res = await scenario(eng, args, n, styles)
                    res.update(mode=variant, max_batch=args.max_batch, workers=args.workers[0], variant=variant)
                    report["scenarios"].append(res)
                    print(f"[gpu_kokoro] {variant} sessions {n}: first audio {res['first_audio_ms']} stalled "
                          f"{res['stalled_fraction']} audio/wall {res['audio_s_per_wall_s']} gpu "
                          f"{res.get('gpu_util_mean')}%", flush=True)
                    dump(args, report)
            finally:
                await eng.aclose()
        del model, graphs
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return report


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from voicebot.engines.tts import kokoro_model as km
    from voicebot.engines.tts.kokoro_batch import MAX_FRAMES, KokoroBatcher, torch_runner

    if args.variants:
        return await run_variants(args, {
            "device": args.device, "cpus": os.cpu_count(), "torch": torch.__version__, "argv": sys.argv,
            "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
            "weights": "random (real Kokoro-82M shape); durations forced to 2-3 frames per phoneme"})
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = km.build_model(km.random_config(), device=args.device)
    params = sum(p.numel() for p in model.parameters())
    load_s = time.perf_counter() - t0
    styles = torch.randn(args.voices, 256) * 0.15  # voice packs: (510, 1, 256) rows ~N(0, 0.15)
    report: dict[str, Any] = {
        "device": args.device, "cpus": os.cpu_count(), "torch": torch.__version__, "argv": sys.argv,
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "weights": "random (real Kokoro-82M shape); 1.07 phonemes per character, durations forced to 2-3 frames per phoneme",
        "parameters": params, "build_s": round(load_s, 2), "policy": args.policy, "scenarios": [],
    }
    print(f"[gpu_kokoro] model built in {load_s:.1f} s, {params / 1e6:.1f} M parameters, {args.device}", flush=True)
    if args.profile:
        out = Path(args.json).with_suffix(".profile.txt") if args.json else None
        report["profile"] = profile_forward(model, args.profile, styles, out)
        dump(args, report)
    if args.count:
        report["op_counts"] = count_forward(model, args.count, styles, args)
        report["op_counts_workload"] = "tiny (4 phonemes x 2 frames)" if args.count_tiny else "replies"
        dump(args, report)
    if args.profile_only or args.count:
        return report
    plans: list[tuple[str, int, int, list[int]]] = []
    if "batched" in args.modes:
        plans += [("batched", args.max_batch, w, args.sessions) for w in args.workers]
    if "streams" in args.modes:
        plans += [("streams", 1, w, args.stream_sessions) for w in args.stream_workers]
    for mode, max_batch, workers, sessions in plans:
        runner = torch_runner(model, max_pad=args.max_pad, max_frames=args.max_frames or MAX_FRAMES,
                          overlap=args.overlap)
        eng = KokoroBatcher(runner, max_batch=max_batch, queue_size=args.queue_size, workers=workers,
                            max_frames=batch_frames(args))
        eng.start()
        try:
            warm = await warm_up(eng, styles, max_batch)
            print(f"[gpu_kokoro] {mode} max-batch {max_batch} workers {workers}: warm-up {warm:.1f} s", flush=True)
            for n in sessions:
                await eng.idle()
                if args.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                res = await scenario(eng, args, n, styles)
                if args.device.startswith("cuda"):
                    res["torch_peak_mem_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
                res.update(mode=mode, max_batch=max_batch, workers=workers)
                report["scenarios"].append(res)
                print(f"[gpu_kokoro] {mode} b{max_batch} w{workers} sessions {n}: first audio {res['first_audio_ms']} "
                      f"stalled {res['stalled_fraction']} audio/wall {res['audio_s_per_wall_s']} batch mean "
                      f"{res['batch_mean']} busy {res['forward_busy']} gpu {res.get('gpu_util_mean')}% "
                      f"cpu {res['process_cpu']}", flush=True)
                dump(args, report)
        finally:
            await eng.aclose()
    return report


def table(report: dict[str, Any]) -> str:
    return scenario_table(report["scenarios"], [
        ("mode", 8, "mode"), ("batch", 6, "max_batch"), ("wkrs", 5, "workers"), ("sessions", 9, "sessions"),
        ("replies", 8, "replies_measured"), FIRST_AUDIO, ("stalled", 9, "stalled_fraction"),
        ("audio s/s", 10, "audio_s_per_wall_s"), ("batch mean", 11, "batch_mean"), ("busy", 6, "forward_busy"),
        ("gpu %", 6, lambda r: r.get("gpu_util_mean", "-")), ("cpu", 6, "process_cpu"),
    ])


def decode_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'variant':<16}{'clauses':>8}{'groups':>7}{'audio s':>8}{'decode ms':>10}{'kernel ms':>10}{'audio s/s':>10}{'captures':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<16}{r['clauses']:>8}  FAILED {r['error'][:80]}")
            continue
        kinds = " ".join(f"{k} {v}%" for k, v in (r.get("kernels") or {}).get("kinds_pct", {}).items())
        lines.append(f"{r['variant']:<16}{r['clauses']:>8}{r['groups']:>7}{r['audio_s']:>8}{r['decode_ms']!s:>10}"
                     f"{r.get('kernel_ms', '-')!s:>10}{r['audio_s_per_s']!s:>10}{r.get('captures', '-')!s:>9}  {kinds}")
    return "\n".join(lines)


def count_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'clauses':>8}{'groups':>7}{'kernels':>9}{'views':>7}{'host ops':>9}{'syncs':>6}  {'forward ms':>10}  syncs by kind"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['clauses']:>8}{r['groups']:>7}{r.get('device_kernels', '-')!s:>9}{r.get('device_views', '-')!s:>7}"
                     f"{r.get('host_ops', '-')!s:>9}{r.get('syncs', '-')!s:>6}  {r['forward_ms_median']!s:>10}  "
                     f"{r.get('syncs_by_kind', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (a CPU smoke run: tiny --sessions)")
    p.add_argument("--sessions", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--modes", nargs="+", choices=["batched", "streams"], default=["batched", "streams"])
    p.add_argument("--max-batch", type=int, default=128, help="batched: clauses per forward at most")
    p.add_argument("--workers", type=int, nargs="+", default=[1], help="batched: forwards at once (one run each)")
    p.add_argument("--stream-workers", type=int, nargs="+", default=[8], help="streams: batch-1 forwards at once")
    p.add_argument("--stream-sessions", type=int, nargs="+", default=[64, 128])
    p.add_argument("--policy", choices=["edf", "fifo"], default="edf",
                   help="edf: later clauses are due when playback reaches them; fifo: all due at once")
    p.add_argument("--max-pad", type=float, default=0.25, help="vocoder groups: padded frames over real, at most 1+this")
    p.add_argument("--max-batch-s", type=float, default=None,
                   help="batched: seconds of speech per forward at most, as tts.max_batch_s (default: no bound)")
    p.add_argument("--max-frames", type=int, default=None,
                   help="vocoder groups: padded frames per forward at most (default: kokoro_batch.MAX_FRAMES)")
    p.add_argument("--overlap", action="store_true",
                   help="CUDA: launch every vocoder group before taking any group's audio (torch_runner overlap)")
    p.add_argument("--queue-size", type=int, default=100_000)
    p.add_argument("--voices", type=int, default=8, help="distinct style vectors spread over the sessions")
    p.add_argument("--sentences", type=int, default=2, help="sentences after the first clause")
    p.add_argument("--listen-s", type=float, nargs=2, default=[2.0, 4.0], help="caller speaks between replies")
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--stall-tolerance-s", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="first profile one forward of N clauses (stage times + torch.profiler table in JSON.profile.txt)")
    p.add_argument("--profile-only", action="store_true", help="stop after --profile")
    p.add_argument("--count", type=int, nargs="+", default=[], metavar="N",
                   help="only count one forward's ops and host-device syncs at these batch sizes, and time it")
    p.add_argument("--count-repeats", type=int, default=3, help="--count: timed forwards per batch size (median)")
    p.add_argument("--count-tiny", action="store_true", help="--count: 4-phoneme clauses (the fixed cost)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                   help="measure each of these forwards in one run (module docstring); --count: decode times")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "float16", "bfloat16"), default=["float32"],
                   help="--variants: each at each of these decode precisions (tts.kokoro_dtype)")
    p.add_argument("--decode-warmup", type=int, default=2, help="--variants --count: untimed runs first (compile, capture)")
    p.add_argument("--kernel-time", action="store_true", help="--variants --count on CUDA: one profiled run's kernel time")
    p.add_argument("--max-wall-s", type=float, default=280.0)
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="torch.backends.cudnn.benchmark: cuDNN times its convolution algorithms per shape at "
                        "the first run of each (the warm-up, before a capture) and keeps the fastest")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cudnn_benchmark:
        import torch

        torch.backends.cudnn.benchmark = True
    report = run_with_deadline(amain(args), args.max_wall_s, "gpu_kokoro")
    if report.get("decode"):
        print(decode_table(report["decode"]))
    elif report.get("op_counts"):
        print(count_table(report["op_counts"]))
    else:
        print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
