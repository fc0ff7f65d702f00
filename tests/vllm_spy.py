"""How a real vLLM ``AsyncLLM.shutdown()`` is called (voicebot/engines/vllm_shutdown.py)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShutdownCall:
    thread: int
    # The engine's output handler was still running when shutdown() began.
    handler_running: bool


def shutdown_threads(engine: Any) -> list[ShutdownCall]:
    """The calls of ``engine.shutdown()`` from now (a spy: the real shutdown still runs)."""
    seen: list[ShutdownCall] = []
    real = engine.shutdown

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        handler = getattr(engine, "output_handler", None)
        running = isinstance(handler, asyncio.Task) and not handler.done()
        seen.append(ShutdownCall(threading.get_ident(), running))
        return real(*args, **kwargs)

    engine.shutdown = shutdown
    return seen


def assert_shut_down_off_the_loop(seen: list[ShutdownCall]) -> None:
    assert seen, "AsyncLLM.shutdown() was not called"
    # It joins the engine-core process (~5 s): on the event loop it stalled every call.
    assert seen[0].thread != threading.get_ident(), "AsyncLLM.shutdown() ran on the event loop's thread"
    # A handler still running when the engine core goes logs an EngineDeadError traceback.
    assert not seen[0].handler_running, "AsyncLLM.shutdown() began with its output handler still running"
