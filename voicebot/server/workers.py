"""``server.workers``: one port served by several processes.

One frontend process is one event loop on one core: ~100 callers at most on a GPU
host, where the engines are shared services (docs/scaling.md). ``voicebot serve`` with
``server.workers: K`` starts K worker processes, each a whole frontend (transports,
sessions, VAD and Smart Turn, the engines' clients), all on the one port:

- this process listens; the workers accept from its socket, each only once its engines
  are loaded and only while it is among the least loaded (voicebot/server/balance.py):
  a worker that is (re)starting gets no calls, a connection waits in the queue until a
  worker can serve it, and calls spread by load, not by a hash;
- admission counts the whole server's calls (``server.max_sessions`` and the
  per-client limit; voicebot/server/siblings.py), ``/metrics`` of any worker reports all
  of them (voicebot/metrics.py), ``/healthz`` lists every worker, and a client secret
  minted by one worker opens a call at any (voicebot/server/client_secrets.py);
- a request only one worker can answer (a WebRTC call's hang-up) is forwarded to it
  over its Unix socket in the server's private folder.

This process only supervises: it checks and pulls like a server of one process,
holds the listening socket (nothing else takes the port between restarts), restarts a
worker that dies (after 1 s, doubling while it keeps dying early) and on
SIGTERM/SIGINT tells every worker to drain; a second signal skips the drain's wait,
a third kills them. The workers need ``llm.backend: remote``: one vLLM serves them all.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from voicebot.config import Config
from voicebot.errors import ConfigError
from voicebot.server.siblings import Siblings

log = logging.getLogger(__name__)

# A worker that dies sooner than this after its start died "early": the next restart
# waits twice as long (up to _MAX_BACKOFF_S), and after _MAX_EARLY_DEATHS in a row of one
# worker the server gives up (a worker that cannot start will not start on the 6th try).
_EARLY_S = 60.0
_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
_MAX_EARLY_DEATHS = 5
_PR_SET_PDEATHSIG = 1


def check_workers(cfg: Config) -> None:
    """A configuration K workers cannot serve: a CLI error before anything starts."""
    if cfg.server.workers < 2:
        return
    if cfg.llm.backend != "remote":
        raise ConfigError(
            f"server.workers {cfg.server.workers} needs llm.backend: remote (one vLLM server for every "
            "worker; each worker would otherwise load the LLM itself): see docs/scaling.md")


# Connections the kernel queues for the workers to accept (uvicorn's default).
_BACKLOG = 2048


def listen_socket(host: str, port: int) -> socket.socket:
    """The port's listening socket (0: a free port), shared by every worker."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(_BACKLOG)
    return sock


def unix_socket(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a dead worker's
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    return sock


@dataclass(frozen=True)
class LogSetup:
    """The parent's logging, for a worker to set up the same (a spawned process starts bare)."""

    levels: dict[str, int]
    json: bool

    @classmethod
    def of_this_process(cls, json: bool) -> LogSetup:
        loggers = ("", "vllm", "httpx", "faster_whisper", "uvicorn.access")
        return cls({name: logging.getLogger(name).level for name in loggers}, json)

    def apply(self, worker: int) -> None:
        from voicebot.observe.logs import WorkerFilter, use_json_logs

        logging.basicConfig(level=self.levels.get("", logging.INFO),
                            format=f"%(asctime)s %(levelname)s w{worker} %(name)s: %(message)s")
        for name, level in self.levels.items():
            if name:
                logging.getLogger(name).setLevel(level)
        if self.json:
            use_json_logs()
        for handler in logging.getLogger().handlers:
            handler.addFilter(WorkerFilter(worker))


def _die_with_parent() -> None:
    """SIGTERM (a drain) when the parent dies: no worker keeps serving the port alone."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent was already gone
        os.kill(os.getpid(), signal.SIGTERM)


def run_worker(cfg: Config, siblings: Siblings, shared: socket.socket, logs: LogSetup) -> None:
    """A spawned worker's entry point: one whole frontend on the shared port."""
    _die_with_parent()
    logs.apply(siblings.index)
    from voicebot.runtime.process import apply_process_settings
    from voicebot.server.app import create_app
    from voicebot.server.http_server import DrainingServer, uvicorn_config
    from voicebot.server.state import ServerState

    apply_process_settings(cfg.server)
    siblings.set_status("loading", pid=os.getpid())
    state = ServerState(cfg, siblings=siblings)
    app = create_app(cfg, state=state)
    own = unix_socket(siblings.socket_path(siblings.index))
    server = DrainingServer(uvicorn_config(cfg, app), state, listen_when_ready=shared, ignore_sigint=True)
    server.run(sockets=[own])
    siblings.set_status("stopped")
    sys.exit(0 if server.started and state.load_error is None else 1)


@dataclass
class _Slot:
    index: int
    process: BaseProcess | None = None
    started_at: float = 0.0
    early_deaths: int = 0
    restart_at: float | None = None
    backoff_s: float = _FIRST_BACKOFF_S
    exit_codes: list[int] = field(default_factory=list)


class WorkerPool:
    """Starts, restarts and stops the workers of one server (this process does nothing else)."""

    def __init__(self, cfg: Config, siblings: Siblings, sock: socket.socket, logs: LogSetup) -> None:
        self.cfg, self.siblings, self.sock, self.logs = cfg, siblings, sock, logs
        self.port = sock.getsockname()[1]
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = [_Slot(i) for i in range(siblings.count)]
        self._signals = 0
        self._failed: str | None = None
        self._all_up = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for slot in self._slots:
            self._start(slot)
        while True:
            live = {slot.process.sentinel: slot for slot in self._slots if slot.process is not None}
            if not live and (self._signals or self._failed):
                break
            now = time.monotonic()
            due = [s.restart_at - now for s in self._slots if s.restart_at is not None]
            timeout = max(0.0, min([1.0, *due]))
            for sentinel in wait(list(live), timeout=timeout):
                self._reap(live[sentinel])  # type: ignore[index]
            self._restart_due()
            if not self._all_up and all(w["status"] == "ok" for w in self.siblings.workers()):
                self._all_up = True
                log.info("all %d workers ready on port %d", len(self._slots), self.port)
        if self._failed:
            log.error("%s", self._failed)
            return 1
        return 0 if all(code == 0 for s in self._slots for code in s.exit_codes[-1:]) else 1

    def _start(self, slot: _Slot) -> None:
        self.siblings.reset(slot.index)
        process = self._ctx.Process(target=run_worker, name=f"voicebot-worker-{slot.index}",
                                    args=(self.cfg, self.siblings.worker(slot.index), self.sock, self.logs))
        process.start()
        slot.process, slot.started_at, slot.restart_at = process, time.monotonic(), None

    def _reap(self, slot: _Slot) -> None:
        from prometheus_client import multiprocess

        process = slot.process
        assert process is not None
        process.join()
        code = process.exitcode if process.exitcode is not None else 1
        slot.exit_codes.append(code)
        slot.process = None
        if process.pid is not None:
            # Its live gauges (open calls, queues) leave the sums; its counters stay.
            multiprocess.mark_process_dead(process.pid)
        self.siblings.reset(slot.index, "stopped")
        if self._signals or self._failed:
            return
        ran_s = time.monotonic() - slot.started_at
        if not self._all_up:
            self._fail(f"worker {slot.index} exited with code {code} before the server was up: see its log above")
            return
        if ran_s < _EARLY_S:
            slot.early_deaths += 1
            slot.backoff_s = min(_MAX_BACKOFF_S, slot.backoff_s * 2) if slot.early_deaths > 1 else _FIRST_BACKOFF_S
        else:
            slot.early_deaths, slot.backoff_s = 0, _FIRST_BACKOFF_S
        if slot.early_deaths >= _MAX_EARLY_DEATHS:
            self._fail(f"worker {slot.index} died {slot.early_deaths} times in a row within {_EARLY_S:.0f} s "
                       "of its start: giving up")
            return
        log.error("worker %d (pid %s) exited with code %d after %.0f s; restarting it in %.0f s",
                  slot.index, process.pid, code, ran_s, slot.backoff_s)
        slot.restart_at = time.monotonic() + slot.backoff_s

    def _restart_due(self) -> None:
        if self._signals or self._failed:
            return
        now = time.monotonic()
        for slot in self._slots:
            if slot.restart_at is not None and slot.restart_at <= now:
                self._start(slot)

    def _fail(self, reason: str) -> None:
        self._failed = reason
        self._tell_workers(signal.SIGTERM)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1:
            log.warning("%s: every worker drains before shutdown", signal.Signals(sig).name)
        # A worker drains at its first SIGTERM and skips the drain's wait at its second.
        self._tell_workers(signal.SIGTERM if self._signals < 3 else signal.SIGKILL)

    def _tell_workers(self, sig: int) -> None:
        for slot in self._slots:
            slot.restart_at = None
            if slot.process is not None and slot.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.process.pid, sig)


def serve_workers(cfg: Config) -> int:
    """Run ``cfg.server.workers`` workers on ``cfg.server.port`` until a signal stops them."""
    check_workers(cfg)
    held = listen_socket(cfg.server.host, cfg.server.port)
    port = held.getsockname()[1]
    try:
        with tempfile.TemporaryDirectory(prefix="voicebot-") as folder:  # mode 0700
            run_dir = Path(folder)
            (run_dir / "metrics").mkdir()
            # Read by prometheus_client as each worker imports it (spawned: a fresh interpreter).
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(run_dir / "metrics")
            siblings = Siblings.create(cfg.server.workers, run_dir)
            log.info("listening on http://%s:%d (WebSocket /ws) with %d workers", cfg.server.host, port,
                     cfg.server.workers)
            pool = WorkerPool(cfg, siblings, held, LogSetup.of_this_process(cfg.server.log_format == "json"))
            code = pool.run()
            # The shared lock's semaphore is unlinked when its last reference goes (the
            # resource tracker warns of a leak at exit otherwise).
            del pool, siblings
            return code
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        held.close()
