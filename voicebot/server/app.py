"""The HTTP/WebSocket application: every transport on one port.

    /ws                native WebSocket protocol (docs/protocol.md)
    /metrics           Prometheus (needs an API key when keys are configured)
    /healthz           readiness, each engine's health, sessions, capacity (JSON;
                       503 with the reason while loading, unhealthy or draining);
                       without an API key (when keys are configured) only ready/status
    /                  the browser client (web/)

Other transports add their routes through :func:`transport_routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from voicebot.config import Config
from voicebot.engines.registry import load_engines
from voicebot.engines.supervisor import Supervisor
from voicebot.runtime.gc_freeze import freeze_loaded_heap
from voicebot.runtime.loop_watch import LoopWatch
from voicebot.server.state import ServerState

log = logging.getLogger(__name__)

# Error code of the event that ends a session whose engine failed under it.
ENGINE_FAILED = "engine_failed"


def transport_routes(state: ServerState) -> list[BaseRoute]:
    """Routes of the configured transports; each module exposes ``routes(state)``."""
    routes: list[BaseRoute] = []
    for name in state.cfg.server.transports:
        module = importlib.import_module(f"voicebot.transports.{name}")
        routes.extend(module.routes(state))
    return routes


# The checkout (or editable install) this package runs from: the default web/ lives there.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def web_root(configured: str) -> Path | None:
    """The folder to serve at '/': a relative ``server.web_root`` from the current
    directory, else from the project this package runs from (the default ``web`` when the
    server is started elsewhere, e.g. by a service manager). None, said once, if neither."""
    path = Path(configured).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, PROJECT_ROOT / path]
    for folder in candidates:
        if folder.is_dir():
            return folder
    log.warning("server.web_root %r is not a folder (looked in %s): the browser page is not served",
                configured, ", ".join(str(c) for c in candidates))
    return None


def create_app(cfg: Config, *, load: bool = True, state: ServerState | None = None) -> Starlette:
    state = state or ServerState(cfg)

    async def metrics(request: Request) -> Response:
        if not state.admin_allowed(request.headers.get("authorization")):
            return Response("unauthorized", 401, {"WWW-Authenticate": "Bearer"})
        state.refresh_metrics()
        workers = state.siblings.pids if state.siblings.count > 1 else None
        return Response(state.metrics.render(workers), media_type="text/plain; version=0.0.4")

    async def healthz(request: Request) -> Response:
        body = state.health()
        code = 200 if body["status"] == "ok" else 503
        if not state.admin_allowed(request.headers.get("authorization")):
            # Readiness stays open to load balancers; the details (reasons, queues) need a key.
            body = {"ready": body["ready"], "status": body["status"]}
        return JSONResponse(body, status_code=code)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        supervisor: list[Supervisor] = []  # filled once the engines are up
        watch = None
        server = state.cfg.server
        if server.loop_stall_s > 0 or server.admission_max_loop_lag_ms > 0:
            watch = LoopWatch(server.loop_stall_s, on_lag=state.metrics.loop_lag.observe,
                              on_stall=state.metrics.loop_stalls.inc,
                              on_late_timeout=state.metrics.late_loop_timeouts.inc)
            state.loop = watch  # admission reads it; it measures once started (after the load)
        runner = asyncio.create_task(_run_engines(state, load, supervisor, watch), name="engines")
        # A worker of several: what its siblings read of it, kept fresh (voicebot/metrics.py).
        ticker = asyncio.create_task(_tell_siblings(state), name="siblings") if state.siblings.count > 1 else None
        try:
            yield
        finally:
            # Order matters: no restart may start an engine behind our back, the
            # sessions go before the engines they use, and a load still in progress is
            # aborted (start_all closes what it had started).
            try:
                if ticker is not None:
                    ticker.cancel()
                    await asyncio.wait([ticker])
                runner.cancel()
                await asyncio.wait([runner])  # waits without raising its CancelledError
                for sup in supervisor:
                    await sup.aclose()
                await state.close_all()
                if state.engines is not None:
                    await state.engines.aclose()
                    state.engines = None
            finally:
                # Watched up to here (closing the engines is where the loop can stall);
                # the full collection below is long, but nothing is left to stall.
                if watch is not None:
                    await watch.aclose()
            # vLLM's AsyncLLM sits in a reference cycle: collected at interpreter teardown,
            # its __del__ shuts down again with module globals gone (a traceback at every
            # exit). Collect it now, while the interpreter is whole (unfrozen first: it
            # was loaded before the heap was frozen).
            gc.unfreeze()
            gc.collect()

    routes: list[BaseRoute] = [
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        *transport_routes(state),
    ]
    web = web_root(cfg.server.web_root)
    if web is not None:
        routes.append(Mount("/", StaticFiles(directory=web, html=True), name="web"))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.voicebot = state
    return app


async def _run_engines(state: ServerState, load: bool, supervisor: list[Supervisor],
                       watch: LoopWatch | None = None) -> None:
    """Load the engines (unless given), then watch the loop and supervise them until cancelled.

    The loop watch starts once the server can take calls: while the models load, import
    threads hold the GIL for half a second at a time, a stall no call sees."""
    loaded_here = state.engines is None
    if state.engines is None:
        if not load:
            return
        try:
            # The engines' clients ask the watch whether a timeout was our loop's.
            state.engines = await load_engines(state.cfg, loop=watch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.error("engines failed to load: %s", state.load_error)
            state.loaded.set()
            return
    if state.engines.specs is not None and not state.sessions:
        # What loading left, out of the collector before the first call (voicebot/server/
        # gc_freeze.py; unfrozen at exit). Engines built by hand (tests) hold nothing of it.
        freeze_loaded_heap()
    if loaded_here:
        log.info("ready: %d session slots", state.cfg.server.max_sessions)
    state.loaded.set()
    if watch is not None:
        watch.start()
    sup = Supervisor(state.engines, on_failure=lambda name, reason: end_sessions(state, reason))
    supervisor.append(sup)
    await sup.run()


# How often a worker of several refreshes its status and its scrape-time gauges: a
# scrape reaches one worker, which reads the others' last values from the shared files.
_SIBLING_TICK_S = 2.0


async def _tell_siblings(state: ServerState) -> None:
    while True:
        state.siblings.set_status(state.status()[0])
        state.refresh_metrics()
        await asyncio.sleep(_SIBLING_TICK_S)


def end_sessions(state: ServerState, reason: str) -> None:
    """An engine failed under every open session: each gets a fatal error event and ends."""
    for session in list(state.sessions.values()):
        session.error(ENGINE_FAILED, f"{reason}; this call cannot go on, please call again", fatal=True)
