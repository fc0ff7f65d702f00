"""A `voicebot serve` child process for the reliability benchmarks (soak, live fuzz).

Started as ``python benchmarks/serverproc.py serve --config ... --port ...``: the real
``voicebot serve`` path (provisioning, uvicorn, lifespan, signal handling), with one
extra route, ``GET /_bench/tasks``, that counts the live asyncio tasks of the server's
loop by name family. The server has no such metric of its own (requested from
LIFECYCLE as ``voicebot_asyncio_tasks``); a task count taken from outside the process
is the only leak figure that needs one.

:class:`ServerProcess` starts it, waits for readiness and samples what a leak would
grow: RSS of the process tree (vLLM's engine core is a child), open descriptors,
threads, tasks, sessions and vLLM's unfinished requests (``/healthz`` queues).
Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
TASKS_PATH = "/_bench/tasks"
HEAP_PATH = "/_bench/heap"
# On top of configs/test.yaml: its random-weight LLM says 24 tokens of CJK that espeak
# spells out for a minute; a small instruct model gives replies of a few seconds.
# The CPU tuning of configs/default.yaml comes along (both cores for vLLM, 32-token blocks).
SERVER_SET = ("llm.model=bundle:qwen2.5-coder-0.5b-instruct", "llm.max_tokens=32",
              "llm.cpu_threads_bind=0-1", "llm.block_size=32")
_SESSION_ID = re.compile(r"(sess|rtc|item|resp)_[0-9a-f]{6,}")


def require_loopback(url: str) -> None:
    """These scripts throw garbage and load at a server: only ever at this machine."""
    host = urlsplit(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"refusing {url!r}: only loopback addresses (127.0.0.1, ::1, localhost)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def task_family(name: str) -> str:
    """'sess_1a2b3c4d5e6f-pacer' -> 'sess-pacer': leaks show up as a growing family."""
    return _SESSION_ID.sub(lambda m: m.group(1), name)


def fd_kinds_of(pid: int) -> dict[str, int]:
    """Open descriptors of ``pid`` by kind ("socket", "pipe", "anon_inode:[eventfd]", a path),
    so a report says *what* grew, not only that something did."""
    kinds: Counter[str] = Counter()
    fd_dir = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                kinds[re.sub(r":\[\d+\]$", "", target)] += 1
    return dict(sorted(kinds.items()))


@dataclass
class ServerProcess:
    """A server child this script owns; its stderr goes to ``log_path``."""

    config: str = "configs/test.yaml"
    overrides: tuple[str, ...] = ()
    port: int = 0
    log_path: Path = Path("artifacts/server.log")
    env: dict[str, str] | None = None  # the server's environment (None: this one's)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> None:
        self.port = self.port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, str(Path(__file__).resolve()), "serve", "--config", self.config,
                "--host", "127.0.0.1", "--port", str(self.port)]
        for item in self.overrides:
            args += ["--set", item]
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(OSError):
                status, body = http_get(self.http + "/healthz", 2.0)
                if status == 200 and json.loads(body).get("ready"):
                    return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT (a clean shutdown), then SIGKILL if it hangs; the exit code."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None

    # ------------------------------------------------------------- sampling
    def health(self) -> dict[str, Any]:
        _, body = http_get(self.http + "/healthz")
        return dict(json.loads(body))

    def heap(self, start_frames: int = 0) -> dict[str, Any]:
        # A snapshot of a server holding a few hundred MB of Python objects takes a while.
        query = f"?start={start_frames}" if start_frames else ""
        _, body = http_get(self.http + HEAP_PATH + query, timeout=300.0)
        return dict(json.loads(body))

    def tasks(self) -> dict[str, Any]:
        _, body = http_get(self.http + TASKS_PATH)
        return dict(json.loads(body))

    def sample(self) -> dict[str, Any]:
        """One row of figures; all of them should come back to baseline when idle."""
        import psutil

        assert self.proc is not None
        main = psutil.Process(self.proc.pid)
        tree = [main, *main.children(recursive=True)]
        rss = 0
        for p in tree:
            with contextlib.suppress(psutil.Error):
                rss += p.memory_info().rss
        # Descriptors are read before this sample's own HTTP requests: the server side of
        # the /healthz or tasks connection may still be open for a moment after the reply,
        # which read afterwards made a spurious "+1 fd" in one soak.
        fds, fd_kinds = main.num_fds(), fd_kinds_of(self.proc.pid)
        threads = main.num_threads()
        rss_main = main.memory_info().rss
        health = self.health()
        queues = health.get("queues") or {}
        tasks = self.tasks()
        _, prom = http_get(self.http + "/metrics")
        trims = re.search(rb"^voicebot_heap_trims_total (\S+)$", prom, re.M)
        return {
            "t": time.time(),
            "rss_mb": round(rss_main / 2**20, 2),
            "tree_rss_mb": round(rss / 2**20, 2),
            "fds": fds,
            "fd_kinds": fd_kinds,
            "threads": threads,
            "tasks": tasks["count"],
            "task_families": tasks["families"],
            "sessions": health.get("active_sessions"),
            "llm_running": queues.get("llm_running"),
            "llm_background_waiting": queues.get("llm_background_waiting"),
            "asr_queue": queues.get("asr"),
            "tts_queue": queues.get("tts"),
            "heap_trims": float(trims.group(1)) if trims else None,
        }

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Until no session, no vLLM request and no engine job is left (or the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.sample()
            idle = not s["sessions"] and not s["llm_running"] and not s["llm_background_waiting"]
            if idle or time.monotonic() > deadline:
                s["idle"] = idle
                return s
            time.sleep(0.5)

    def log_problems(self) -> dict[str, Any]:
        """Tracebacks and ERROR lines in what the server wrote."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        lines = text.splitlines()
        tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
        errors = [line for line in lines if " ERROR " in line or line.startswith("ERROR")]
        first = "\n".join(lines[tracebacks[0]: tracebacks[0] + 40]) if tracebacks else None
        # Counted apart, not excused: one after "Finished server process" is a teardown bug.
        end = next((i for i, line in enumerate(lines) if "Finished server process" in line), len(lines))
        # voicebot/runtime/loop_watch.py: "has not run for" (with the stack it is blocked
        # at) while the loop is blocked, "was blocked for" once it runs again.
        stalls = [i for i, line in enumerate(lines) if "the event loop was blocked for" in line]
        stuck = [i for i, line in enumerate(lines) if "the event loop has not run for" in line]
        return {"lines": len(lines), "tracebacks": len(tracebacks),
                "tracebacks_at_exit": sum(i > end for i in tracebacks), "error_lines": len(errors), "first_traceback": first,
                "errors_sample": errors[:10],
                "loop_stalls": len(stalls), "loop_stall_lines": [lines[i] for i in stalls[:10]],
                "first_loop_stack": "\n".join(lines[stuck[0]: stuck[0] + 40]) if stuck else None}


def _install_task_route() -> None:
    """Wrap create_app so the app it builds also answers GET /_bench/tasks."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    import voicebot.server.app as app_module

    original = app_module.create_app

    async def heap(request: Request) -> JSONResponse:
        """``?start=FRAMES``: trace Python allocations from now on (started late: tracing a
        vLLM start makes it minutes slower); otherwise: the traced blocks still alive, by
        allocation site, i.e. what the server has kept since the start."""
        import gc
        import tracemalloc

        if frames := int(request.query_params.get("start", "0") or 0):
            tracemalloc.start(frames)
            return JSONResponse({"tracing": True})
        if not tracemalloc.is_tracing():
            return JSONResponse({"error": "not tracing: GET ?start=FRAMES first"}, 409)
        gc.collect()
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        stats = snap.statistics("traceback")
        top = [
            {"kb": round(st.size / 1024, 1), "count": st.count,
             "where": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in st.traceback][-6:]}
            for st in stats[:25]
        ]
        return JSONResponse({"growth_kb": round(sum(st.size for st in stats) / 1024, 1), "top": top})

    def create_app(*args: Any, **kwargs: Any) -> Any:
        app = original(*args, **kwargs)

        async def tasks(_: Request) -> JSONResponse:
            names = [task_family(t.get_name()) for t in asyncio.all_tasks() if not t.done()]
            return JSONResponse({"count": len(names), "families": dict(Counter(names).most_common())})

        app.router.routes.insert(0, Route(TASKS_PATH, tasks))
        app.router.routes.insert(0, Route(HEAP_PATH, heap))
        return app

    app_module.create_app = create_app


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] != "serve":
        print("usage: serverproc.py serve [voicebot serve options]", file=sys.stderr)
        return 2
    _install_task_route()
    from voicebot.cli import main as cli_main

    os.chdir(ROOT)
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
