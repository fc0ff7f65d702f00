"""Shut a vLLM ``AsyncLLM`` down without stopping the event loop.

``AsyncLLM.shutdown()`` joins the engine-core process: vLLM waits for it to exit, then
kills it (~5 s on the CPU default). Called on the loop, that stalled every call and
``/healthz`` at each exit and each supervised restart (voicebot/server/loop_watch.py
caught it: 4.91 s). vLLM is built to be shut down from a thread: its own liveness monitor
does so, and what lives on the loop (the output handler task, the zmq sockets) it closes
there with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def shut_down(engine: Any) -> None:
    """``engine.shutdown()`` on a thread, then wait (up to 5 s) for its output handler,
    which vLLM cancels on this loop."""
    handler = getattr(engine, "output_handler", None)
    await asyncio.to_thread(engine.shutdown)
    if isinstance(handler, asyncio.Task) and not handler.done():
        await asyncio.wait([handler], timeout=5.0)
