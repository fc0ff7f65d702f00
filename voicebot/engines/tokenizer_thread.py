"""The one thread that tokenizes off the event loop (a summary's prompt, up to the
history budget of text: a few ms that the loop should not spend).

vLLM's tokenizer is thread-safe through a pool of deep copies (``renderer_num_workers +
1``, two by default): a borrower that finds the pool empty deep-copies the tokenizer on
the spot, ~1 s holding the GIL, which stalls the event loop of every call even from a
thread, and the pool keeps the copy. The loop borrows one at a time; with every other
borrower on this single thread no more than two are ever out at once, however many
calls summarise together. Work queues here in order; each item is short.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["run_tokenizer"]

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _get() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voicebot-tokenizer")
        return _executor


async def run_tokenizer(fn: Callable[[], T]) -> T:
    """``fn()`` on the tokenizer thread; cancelling the caller leaves a started ``fn`` to
    finish there (it is short) and drops its result."""
    return await asyncio.get_running_loop().run_in_executor(_get(), fn)
