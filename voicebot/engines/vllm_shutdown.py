"""Shut a vLLM ``AsyncLLM`` down without stopping the event loop.

``AsyncLLM.shutdown()`` joins the engine-core process: vLLM waits for it to exit, then
kills it (~5 s on the CPU default). Called on the loop, that stalled every call and
``/healthz`` at each exit and each supervised restart (voicebot/server/loop_watch.py
caught it: 4.91 s). vLLM is built to be shut down from a thread: its liveness monitor
shuts its engine client down from one (``MPClient.shutdown``), and what lives on the loop
(the output handler task, the zmq sockets, the output-queue task) it closes there with
``call_soon_threadsafe``. Callers stop using the engine first (``_engine = None``, decodes
cancelled): a request started during the shutdown would open sockets from the loop.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def shut_down(engine: Any) -> None:
    """``engine.shutdown()`` on a thread, then wait (up to 5 s) for its output handler,
    which vLLM cancels on this loop."""
    handler = getattr(engine, "output_handler", None)
    closing = asyncio.ensure_future(asyncio.to_thread(engine.shutdown))
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        # A cancelled close (a supervisor stopping a restart) still waits for the engine
        # core to be gone: cancelling to_thread does not stop the thread, and the caller
        # has already dropped its reference to the engine.
        await asyncio.wait([closing])
        raise
    if isinstance(handler, asyncio.Task) and not handler.done():
        await asyncio.wait([handler], timeout=5.0)
