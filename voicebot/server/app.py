"""The HTTP/WebSocket application: every transport on one port.

    /ws                native WebSocket protocol (docs/protocol.md)
    /metrics           Prometheus
    /healthz           readiness, engines, sessions, capacity (JSON)
    /                  the browser client (web/)

Other transports add their routes through :func:`transport_routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from voicebot.engines import load_engines
from voicebot.server.state import ServerState

log = logging.getLogger(__name__)


def transport_routes(state: ServerState) -> list[BaseRoute]:
    """Routes of the configured transports; each module exposes ``routes(state)``."""
    routes: list[BaseRoute] = []
    for name in state.cfg.server.transports:
        module = importlib.import_module(f"voicebot.transports.{name}")
        routes.extend(module.routes(state))
    return routes


def create_app(cfg: Config, *, load: bool = True, state: ServerState | None = None) -> Starlette:
    state = state or ServerState(cfg)

    async def metrics(_: Request) -> Response:
        state.update_gauges()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    async def healthz(_: Request) -> Response:
        body = state.health()
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state)) if load and state.engines is None else None
        try:
            yield
        finally:
            if loader is not None:
                loader.cancel()
                await asyncio.wait([loader])  # waits without raising its CancelledError
            await state.close_all()
            if state.engines is not None:
                await state.engines.aclose()
                state.engines = None

    routes: list[BaseRoute] = [
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        *transport_routes(state),
    ]
    web = Path(cfg.server.web_root)
    if web.is_dir():
        routes.append(Mount("/", StaticFiles(directory=web, html=True), name="web"))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.voicebot = state
    return app


async def _load(state: ServerState) -> None:
    try:
        state.engines = await load_engines(state.cfg)
        log.info("ready: %d session slots", state.cfg.server.max_sessions)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("engines failed to load: %s", state.load_error)
