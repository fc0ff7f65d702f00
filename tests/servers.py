"""Run the real app in-process on a real socket, with real engines.

In-process (not a subprocess) so tests can look inside afterwards: the open
sessions, vLLM's unfinished requests, the tasks still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import uvicorn

from voicebot.config import Config
from voicebot.engines import load_engines
from voicebot.server.app import create_app
from voicebot.server.state import ServerState


@dataclass
class RunningServer:
    state: ServerState
    port: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ws(self, path: str = "/ws") -> str:
        return f"ws://127.0.0.1:{self.port}{path}"


@contextlib.asynccontextmanager
async def running_server(cfg: Config, state: ServerState | None = None) -> AsyncIterator[RunningServer]:
    """Load engines (unless ``state`` already has them), serve, and shut down cleanly."""
    state = state or ServerState(cfg)
    if state.engines is None:
        state.engines = await load_engines(cfg)
    try:
        app = create_app(cfg, load=False, state=state)
    except BaseException:
        # Nothing will run the lifespan that would close them: no engine process may
        # outlive a failed start.
        await state.engines.aclose()
        raise
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            ws="websockets-sansio",
            ws_max_size=16 << 20,
            lifespan="on",
            log_level="warning",
        )
    )
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(60):
            while not server.started:
                if task.done():
                    task.result()  # surfaces why it could not start
                await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield RunningServer(state, port)
    finally:
        server.should_exit = True
        await task  # the app's lifespan closes sessions and engines


@contextlib.contextmanager
def server_errors() -> Iterator[list[logging.LogRecord]]:
    """Every ERROR the server logs (uvicorn's "Exception in ASGI application" included:
    uvicorn's loggers do not propagate to the root logger that caplog watches)."""
    seen: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Catch(logging.ERROR)
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "voicebot")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield seen
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
