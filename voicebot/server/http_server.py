"""The HTTP/WebSocket server under the app: uvicorn's settings, and a uvicorn that drains
the calls on SIGTERM/SIGINT before it stops (voicebot/server/drain.py). ``voicebot serve``
runs one (voicebot/server/run.py), or one in each worker of a port (workers.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from voicebot.config import Config
from voicebot.server.balance import SharedListener
from voicebot.server.drain import drain
from voicebot.server.state import ServerState
from voicebot.server.ws_protocol import protocol_class
from voicebot.transports import realtime_events

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM/SIGINT first drain the sessions (voicebot/server/drain.py).

    uvicorn's own handling stops listening at once (``/healthz`` unreachable, so a load
    balancer cannot see "draining") and closes every WebSocket with 1012 mid-reply; it
    also re-raises the signal after shutdown, so the process never exits 0. Here the
    first signal starts the drain and the server stops when it is done; a second one
    skips the wait, a third SIGINT forces the exit.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, *,
                 listen_when_ready: socket.socket | None = None, ignore_sigint: bool = False) -> None:
        """``listen_when_ready``: the listening socket of a port shared with sibling workers
        (voicebot/server/workers.py), accepted from only once the engines are loaded and
        only in turn with them (voicebot/server/balance.py). ``ignore_sigint``: a worker,
        whose parent turns a terminal's Ctrl-C (which reaches the whole process group)
        into one SIGTERM each."""
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._deferred = listen_when_ready
        self._listener: SharedListener | None = None
        self._ignore_sigint = ignore_sigint

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        opener = None
        if self._deferred is not None:
            opener = asyncio.create_task(self._listen_when_ready(self._deferred), name="listen")
        try:
            await super().serve(sockets)
        finally:
            if opener is not None:
                opener.cancel()
                await asyncio.wait([opener])

    async def _listen_when_ready(self, sock: socket.socket) -> None:
        await self.state.loaded.wait()
        if self.state.load_error is not None:
            self.should_exit = True  # the worker exits 1; its parent says so
            return
        # uvicorn sets no event for its startup, which is quick.
        while not self.started and not self.should_exit:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self.should_exit:
            return
        # The protocol factory uvicorn's startup builds for the sockets it is given (its
        # attributes server_state and lifespan.state): a connection accepted here is then
        # uvicorn's like any other (its shutdown closes it). Covered by
        # tests/e2e/test_scale_out.py (workers).
        protocol = functools.partial(self.config.http_protocol_class, config=self.config,  # type: ignore[call-arg]
                                     server_state=self.server_state, app_state=self.lifespan.state)
        self._listener = SharedListener(sock, self.state.siblings, protocol)
        self._listener.start()
        self.state.siblings.set_status(self.state.status()[0])  # the balance counts it from now
        log.info("ready: serving the shared port %d", sock.getsockname()[1])

    async def shutdown(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        if self._listener is not None:  # first, as uvicorn stops its own listeners first
            self._listener.close()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: runs between two bytecodes of the loop's thread, so it only
        # hands the work to the loop. Not recorded in _captured_signals: no re-raise.
        if self._ignore_sigint and sig == signal.SIGINT:
            return
        if self._loop is None or self.should_exit:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        if self._drain is None:
            log.warning("%s: draining before shutdown", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            log.warning("%s again: closing the remaining sessions now", signal.Signals(sig).name)
            self.should_exit = True

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit(), name="drain")

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.state, self.state.cfg.server.drain_timeout_s)
        finally:
            self.should_exit = True


def uvicorn_config(cfg: Config, app: Any, **overrides: Any) -> uvicorn.Config:
    """The HTTP/WebSocket server's settings (the tests' servers take them too)."""
    settings: dict[str, Any] = dict(
        # uvicorn's websockets-sansio protocol, with a deadline on a client that stopped reading.
        ws=protocol_class(cfg.server.send_timeout_s),
        # A frame up to this size reaches our handler, which answers one over
        # server.max_message_bytes with an error event and goes on; beyond it the
        # connection is closed (1009) before it is buffered. At least what an OpenAI
        # Realtime client may send in one event (15 MiB of audio), so that no such
        # client loses its call over one large append.
        ws_max_size=max(4 * cfg.server.max_message_bytes, realtime_events.MAX_FRAME_BYTES),
        ws_per_message_deflate=cfg.server.ws_compression,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        log_level="info",
        access_log=False,
        # The drain already let the sessions go; this bounds what is left (a stuck request).
        timeout_graceful_shutdown=5,
    )
    if cfg.server.log_format == "json":
        # uvicorn's own handlers write text: its loggers go to the root's JSON handler instead.
        settings["log_config"] = None
    return uvicorn.Config(app, **(settings | overrides))
