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

An engine core can also die before its shutdown (a crash, the OOM killer, a kill): its
processes can then no longer be asked what shared memory they hold, so what they held is
listed once the engine runs (:func:`listed`) and released at its shutdown as well.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import psutil

from voicebot.engines import shm


@dataclass(frozen=True)
class Listed:
    """An engine's processes and what they held in /dev/shm (its rings and locks, made
    at start-up), listed while it ran."""

    procs: list[psutil.Process] = field(default_factory=list)
    held: set[str] = field(default_factory=set)


async def listed(engine: Any) -> Listed:
    """The engine's processes and their shared memory, now (call once it runs)."""

    def read() -> Listed:
        procs = shm.tree(_engine_pids(engine))
        return Listed(procs, shm.held(procs))

    return await asyncio.to_thread(read)


async def shut_down(engine: Any, started: Listed | None = None) -> None:
    """Stop the engine's output handler on this loop, then ``engine.shutdown()`` on a
    thread, then release the shared memory its processes left (also what ``started``
    listed, for an engine core that died first). Runs to the end even if cancelled (then
    re-raises): the caller has already dropped its reference, and a half-closed engine
    would leave its processes behind."""
    closing = asyncio.ensure_future(_shut_down(engine, started or Listed()))
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        # Cancelling to_thread does not stop the thread: wait for the engine core to be
        # gone (a supervisor stopping a restart cancels this).
        await asyncio.wait([closing])
        raise


async def _shut_down(engine: Any, started: Listed) -> None:
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
    # released after, with what they held at start-up (the processes of a dead engine
    # core are gone, or orphaned out of its tree: they are waited for too).
    procs = await asyncio.to_thread(shm.tree, _engine_pids(engine))
    procs += [p for p in started.procs if p not in procs]
    rings = await asyncio.to_thread(shm.held, procs) | started.held
    await asyncio.to_thread(engine.shutdown)
    await asyncio.to_thread(shm.release_after, procs, rings, 5.0)


def _engine_pids(engine: Any) -> list[int]:
    """The engine-core processes of an ``AsyncLLM`` (none if vLLM names them otherwise)."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", None) or [] if getattr(p, "pid", None) is not None]
