"""Shut a vLLM ``AsyncLLM`` down without stopping the event loop.

``AsyncLLM.shutdown()`` joins the engine-core process: vLLM waits for it to exit, then
kills it (~5 s on the CPU default). Called on the loop, that stalled every call and
``/healthz`` at each exit and each supervised restart (voicebot/runtime/loop_watch.py
caught it: 4.91 s). vLLM is built to be shut down from a thread: its liveness monitor
shuts its engine client down from one (``MPClient.shutdown``), and what lives on the loop
(the output handler task, the zmq sockets, the output-queue task) it closes there with
``call_soon_threadsafe``. Callers stop using the engine first (``_engine = None``, decodes
cancelled): a request started during the shutdown would open sockets from the loop. The
output handler is cancelled here on the loop before the thread starts (see ``_shut_down``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from voicebot.engines import shm


async def shut_down(engine: Any) -> None:
    """Stop the engine's output handler on this loop, then ``engine.shutdown()`` on a
    thread. Runs to the end even if cancelled (then re-raises): the caller has already
    dropped its reference, and a half-closed engine would leave its processes behind."""
    closing = asyncio.ensure_future(_shut_down(engine))
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        # Cancelling to_thread does not stop the thread: wait for the engine core to be
        # gone (a supervisor stopping a restart cancels this).
        await asyncio.wait([closing])
        raise


async def _shut_down(engine: Any) -> None:
    # The output handler first. vLLM cancels it only after the engine core has exited
    # (~5 s later), from its thread; in between, the closed output socket hands the
    # handler an EngineDeadError, which it logs as "AsyncLLM output_handler failed" with
    # a traceback whenever it runs before its cancellation lands (one exit in two of the
    # CPU default). Nobody reads its outputs any more: the callers stopped first.
    handler = getattr(engine, "output_handler", None)
    if isinstance(handler, asyncio.Task) and not handler.done():
        handler.cancel()
        await asyncio.wait([handler], timeout=5.0)
    # vLLM force-kills an engine core that outlives its shutdown grace, before it can
    # unlink its shared-memory rings and semaphores (voicebot/engines/shm.py): listed now,
    # released after.
    procs = await asyncio.to_thread(shm.tree, _engine_pids(engine))
    rings = await asyncio.to_thread(shm.held, procs)
    await asyncio.to_thread(engine.shutdown)
    await asyncio.to_thread(shm.release_after, procs, rings, 5.0)


def _engine_pids(engine: Any) -> list[int]:
    """The engine-core processes of an ``AsyncLLM`` (none if vLLM names them otherwise)."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", None) or [] if getattr(p, "pid", None) is not None]
