"""The streaming FastConformer's batched step: how long one step for N streams takes,
eager and as CUDA graphs.

    python benchmarks/fastconformer_streams.py --device cuda --dtype bfloat16 --streams 1 64 256 512 1024 --modes eager graphs --json OUT
    python benchmarks/fastconformer_streams.py --device cpu --dtype float32 --tiny --streams 1 8 24 --modes eager static --json OUT

One step is what ``asr.backend: fastconformer`` runs for every active stream at once
(``voicebot/engines/asr/fastconformer_model.py``, ``SlotPool.step``): the log-mel of each
stream's new chunk, the cache-aware encoder over all of them in one forward, and the greedy
RNN-T decode of their frames (a fixed ``max_symbols_per_step`` symbol iterations per frame,
no host sync until the tokens are read). Streams are in steady state (their attention window
full); each chunk is fresh noise. Modes, each on one pool of max(N) slots per lookahead:
``eager`` runs the step on exactly N rows; ``static`` pads the rows to the next of the step
buckets (powers of two and halfway points, as ``asr.fastconformer.cuda_graphs`` does) and runs
it eagerly; ``graphs`` (CUDA only) captures each bucket's step as a CUDA graph first
(``capture_s``) and replays it. Per mode, N and lookahead: the step's p50/p95 in ms, the
rows it ran, the real-time factor (chunk length / p50 step: above 1 keeps up) and the
streams one step loop could carry at that N (N x RTF), the tokens decoded per step, and on a
GPU the memory in use.

Weights: random, of the real shape (Nemotron Speech Streaming EN 0.6B, 618 M parameters; no
checkpoint is needed) or ``--tiny`` (two layers, 64 wide) or a checkpoint directory
(``--model``). Random weights decode whatever their argmax says: up to
``max_symbols_per_step`` (10) symbols a frame, a pessimistic load for the decoder.

Needs torch and transformers (with NemotronAsrStreamingForRNNT) only.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench_util import (
    JSON_EPILOG,
    bare_engines_package,
    run_with_deadline,
    summarise_ms,
    write_result,
)


def make_pool(fm: Any, model: Any, slots: int, lookahead: int, mode: str) -> tuple[Any, float]:
    """The pool a mode steps, and how long building it took (the capture, for graphs)."""
    t0 = time.perf_counter()
    if mode == "eager":
        pool = fm.SlotPool(model, slots, lookahead)
    else:
        pool = fm.SlotPool(model, slots, lookahead, buckets=fm.step_buckets(slots), cuda_graphs=mode == "graphs")
    return pool, time.perf_counter() - t0


def measure(fm: Any, pool: Any, n: int, steps: int) -> dict[str, Any]:
    import numpy as np
    import torch

    rng = np.random.default_rng(0)

    def rows(first: bool) -> list[Any]:
        size = fm.samples_for(pool.chunk_mel_frames(first))
        return [fm.Row(i, (rng.standard_normal(size) * 0.1).astype(np.float32), first) for i in range(n)]

    cuda = pool.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    pool.step(rows(True))
    warmup = pool.window // pool.chunk_frames + 2  # the attention window fills up
    times, tokens = [], []
    for i in range(warmup + steps):
        batch = rows(False)
        t0 = time.perf_counter()
        out = pool.step(batch)  # ends with the tokens on the host: synchronised
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
            tokens.append(sum(len(t) for t in out))
    chunk_ms = pool.chunk_frames * 80
    p50 = summarise_ms(times, 2)["p50"]
    res: dict[str, Any] = {
        "streams": n, "rows": pool.rows_for(n), "lookahead": pool.lookahead, "chunk_ms": chunk_ms,
        "step_ms": summarise_ms(times, 2), "rtf": round(chunk_ms / p50, 2),
        "streams_at_this_n": int(n * chunk_ms / p50), "tokens_per_step": round(sum(tokens) / len(tokens), 1),
    }
    if cuda:
        res["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return res


async def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    bare_engines_package()
    from voicebot.engines.asr import fastconformer_model as fm

    if "graphs" in args.modes and args.device != "cuda":
        raise SystemExit("--modes graphs needs --device cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.model:
        model = fm.load_model(args.model, args.device, args.dtype)
    else:
        model = fm.ready(fm.random_model(tiny=args.tiny)[0], args.device, args.dtype)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f} M parameters on {args.device} ({args.dtype}) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    print(f"{'mode':>6} {'r':>3} {'chunk':>6} {'N':>6} {'rows':>6} | {'p50 ms':>8} {'p95 ms':>8} | "
          f"{'RTF':>7} {'streams':>8} {'tok/step':>9}")
    results: dict[str, Any] = {"params": params, "device": args.device, "dtype": args.dtype, "pools": [], "runs": []}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
    slots = max(args.streams)
    for lookahead in args.lookahead:
        for mode in args.modes:
            try:
                pool, build_s = make_pool(fm, model, slots, lookahead, mode)
            except Exception as exc:  # a capture that fails must not lose the other modes' figures
                results["pools"].append({"mode": mode, "lookahead": lookahead, "error": f"{exc!r}"[:500]})
                write_result(args.json, "fastconformer_streams", args, results)
                print(f"{mode:>6} {lookahead:>3}: {exc!r}", flush=True)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                continue
            results["pools"].append({"mode": mode, "lookahead": lookahead, "slots": slots, "buckets": pool.buckets,
                                     "capture_s" if mode == "graphs" else "build_s": round(build_s, 2)})
            for n in args.streams:
                try:
                    res = {"mode": mode, **measure(fm, pool, n, args.steps)}
                except torch.cuda.OutOfMemoryError as exc:
                    res = {"mode": mode, "streams": n, "lookahead": lookahead, "error": f"OOM: {str(exc)[:200]}"}
                    torch.cuda.empty_cache()
                results["runs"].append(res)
                write_result(args.json, "fastconformer_streams", args, results)
                if "error" in res:
                    print(f"{mode:>6} {lookahead:>3} N={n}: {res['error']}", flush=True)
                    continue
                s = res["step_ms"]
                print(f"{mode:>6} {lookahead:>3} {res['chunk_ms']:>4}ms {n:>6} {res['rows']:>6} | {s['p50']:>8.2f} "
                      f"{s['p95']:>8.2f} | {res['rtf']:>7.2f} {res['streams_at_this_n']:>8} {res['tokens_per_step']:>9}",
                      flush=True)
            del pool
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return results


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=JSON_EPILOG)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--tiny", action="store_true", help="the tiny random model (CPU smoke runs)")
    p.add_argument("--model", help="a NemotronAsrStreamingForRNNT checkpoint directory instead of random weights")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256, 512, 1024], help="N: streams per step")
    p.add_argument("--lookahead", type=int, nargs="+", default=[1, 6], help="right context r: chunks of (r+1) x 80 ms")
    p.add_argument("--modes", nargs="+", choices=["eager", "static", "graphs"], default=["eager"],
                   help="eager: N rows; static: rows padded to the step buckets, eager; graphs: those captured as "
                        "CUDA graphs (--device cuda)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per N (after the window fills)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--max-wall-s", type=float, default=580.0, help="exit (code 3) after this long")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse()
    run_with_deadline(main(ARGS), ARGS.max_wall_s, "fastconformer_streams")
