"""What a frontend's own HTTP client adds to the remote LLM tier's time to first token.

    python benchmarks/llm_client.py --sessions 16 43 128 --json artifacts/llm_client.json

On the GPU, all at once at 256 callers over six frontend workers, a frontend waited 2-10x
the LLM engine's own TTFT for its first token (docs/gpu-results.md). Part of that lies in
the frontend: each worker streams ~43 replies (and their background prefills) at once.
This measures that part alone, on any machine: a stand-in tier in a process of its own
(frontend_cost.py's fake of vLLM's OpenAI server on uvicorn, vLLM's own server stack: its
first chunk at once, then one token every ``--step-ms`` up to ``--steps``, as a decoding
server streams them) and, in this process,
the frontend's real :class:`~voicebot.engines.llm.remote.RemoteLlmEngine` asking for N
replies at once, ``--rounds`` times per N (after one unmeasured round). TTFT is what a
session sees (``GenerationStats.ttft_s``): from the call to the first token. The stand-in
answers at once, so all of it is the two processes' HTTP work on this host's cores, the
client's mostly. Also this process's CPU time per reply.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_util import JSON_EPILOG, summarise_ms, write_result  # noqa: E402
from serverproc import free_port  # noqa: E402


def serve(port: int, tokenizer: str, step_s: float) -> None:
    """The stand-in tier, until terminated."""
    import uvicorn
    from frontend_cost import llm_app  # benchmarks/, beside this file

    uvicorn.run(llm_app(tokenizer, 0.0, 1.0 / step_s), host="127.0.0.1", port=port, log_level="warning",
                access_log=False)


def tokenizer_dir() -> str:
    """A tokenizer with its model's config (vLLM reads both): the tests' tiny random Qwen3."""
    from voicebot.config import ModelsConfig
    from voicebot.provision import pull

    return str(pull(["qwen3-tiny-random"], ModelsConfig(), log=lambda _: None, verify=False)["qwen3-tiny-random"])


async def measure(args: argparse.Namespace, url: str, tokenizer: str) -> list[dict[str, Any]]:
    from voicebot.config import LlmConfig, RemoteLlmConfig
    from voicebot.engines.contracts import GenerationStats, Lane
    from voicebot.engines.llm.remote import RemoteLlmEngine
    most = max(args.sessions)
    cfg = LlmConfig(backend="remote", remote=RemoteLlmConfig(url=url, max_connections=max(64, 2 * most)))
    engine = RemoteLlmEngine(cfg, tokenizer)
    await engine.start()
    prompt = list(range(100, 100 + args.prompt_tokens))

    async def reply(k: int) -> float:
        st = GenerationStats(request_id=f"r{k}", lane=Lane.INTERACTIVE)
        async for _ in engine.generate(prompt, max_tokens=args.steps, stats=st):
            pass
        assert st.ttft_s is not None
        return st.ttft_s * 1000

    rows = []
    try:
        for n in args.sessions:
            ttfts: list[float] = []
            cpu = 0.0
            for r in range(args.rounds + 1):  # round 0: connections opened, not measured
                c0 = time.process_time()
                got = await asyncio.gather(*(reply(k) for k in range(n)))
                if r:
                    ttfts += got
                    cpu += time.process_time() - c0
            row = {"sessions": n, "replies": len(ttfts), "ttft_ms": summarise_ms(ttfts),
                   "client_cpu_ms_per_reply": round(1000 * cpu / len(ttfts), 2)}
            rows.append(row)
            t = row["ttft_ms"]
            print(f"N={n:4d}  TTFT ms p50 {t['p50']}  p95 {t['p95']}  p99 {t['p99']}  "
                  f"client CPU {row['client_cpu_ms_per_reply']} ms a reply", flush=True)
    finally:
        await engine.aclose()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, epilog=JSON_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, nargs="+", default=[16, 43, 128], help="replies asked for at once")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per level")
    ap.add_argument("--steps", type=int, default=30, help="tokens per reply (at most the stand-in's reply)")
    ap.add_argument("--step-ms", type=float, default=25.0, help="the stand-in's time between tokens")
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the stand-in tier's process: its port
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)  # and the tokenizer it streams with
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.tokenizer, args.step_ms / 1000)
        return
    tokenizer = tokenizer_dir()
    port = free_port()
    tier = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--tokenizer", tokenizer,
                             "--step-ms", str(args.step_ms)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        rows = asyncio.run(measure(args, f"http://127.0.0.1:{port}", tokenizer))
    finally:
        tier.terminate()
        tier.wait(10)
    write_result(args.json, "llm_client", args, {"levels": rows})


if __name__ == "__main__":
    main()
