"""What ``voicebot asr-serve`` and ``tts-serve`` share as processes: the listener, the
run until SIGINT / SIGTERM, the frozen heap and the watched loop while serving
(:mod:`voicebot.runtime`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from websockets.asyncio.server import ServerConnection, serve

from voicebot.runtime.gc_freeze import frozen_heap
from voicebot.runtime.loop_watch import watching_loop
from voicebot.services.wire import PING_INTERVAL_S, PING_TIMEOUT_S

if TYPE_CHECKING:
    from voicebot.config import ServerConfig

__all__ = ["listen", "quiet_server_log", "run_service", "serve_until_stopped", "stop_on_signals"]


def listen(handler: Callable[[ServerConnection], Awaitable[None]], host: str, port: int, *, max_size: int) -> serve:
    """A service's WebSocket server (use as ``async with``)."""
    return serve(
        handler,
        host,
        port,
        max_size=max_size,
        compression=None,
        ping_interval=PING_INTERVAL_S,
        ping_timeout=PING_TIMEOUT_S,
    )


async def serve_until_stopped(server: serve, stop: asyncio.Event, on_ready: Callable[[str], None], *,
                              close: Sequence[Callable[[], Awaitable[None]]] = (),
                              loop_stall_s: float = 0.0) -> None:
    """Run a service's listener (``listen(...)``) until ``stop`` is set or SIGINT / SIGTERM
    comes; ``on_ready`` gets its URL once it listens; then ``close`` in order (the service,
    then its engine). With ``loop_stall_s`` the loop every frontend's requests share is
    watched as the server's is (voicebot/runtime/loop_watch.py), closing included: the
    engine is loaded by then (its start holds the GIL in long stretches no request sees)."""
    # The heap the engine loaded is frozen out of the garbage collector while serving
    # (voicebot/runtime/gc_freeze.py): a full collection of it stalls every frontend.
    with frozen_heap():
        async with watching_loop(loop_stall_s):
            try:
                with stop_on_signals(stop):
                    async with server as running:
                        bound = next(iter(running.sockets)).getsockname()
                        on_ready(f"ws://{bound[0]}:{bound[1]}")
                        await stop.wait()
            finally:
                for step in close:
                    await step()


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` while inside (the service closes its engine cleanly)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


def quiet_server_log() -> None:
    """websockets logs "connection open/closed" at INFO, one pair per stats probe."""
    ws_log = logging.getLogger("websockets.server")
    if ws_log.level == logging.NOTSET:
        ws_log.setLevel(logging.WARNING)


def run_service(
    kind: str, server: ServerConfig, main: Callable[[Callable[[str], None]], Coroutine[Any, Any, None]]
) -> int:
    """``voicebot asr-serve`` / ``tts-serve``: runs ``main(ready)``, whose ``ready(url)`` prints
    one JSON line ``{"<kind>_service": URL}`` once it listens."""
    from voicebot.runtime.process import apply_process_settings

    def ready(url: str) -> None:
        print(json.dumps({f"{kind}_service": url}), flush=True)

    quiet_server_log()
    # Process-wide settings, as `voicebot serve` makes them, before the engine starts its threads.
    apply_process_settings(server)
    asyncio.run(main(ready))
    return 0
