"""Where a real vLLM ``AsyncLLM.shutdown()`` runs (voicebot/engines/vllm_shutdown.py)."""

from __future__ import annotations

import threading
from typing import Any


def shutdown_threads(engine: Any) -> list[int]:
    """The ids of the threads ``engine.shutdown()`` is called on from now (a spy: the real
    shutdown still runs)."""
    seen: list[int] = []
    real = engine.shutdown

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.get_ident())
        return real(*args, **kwargs)

    engine.shutdown = shutdown
    return seen


def assert_shut_down_off_the_loop(seen: list[int]) -> None:
    # It joins the engine-core process (~5 s): on the event loop it stalled every call.
    assert seen, "AsyncLLM.shutdown() was not called"
    assert seen[0] != threading.get_ident(), "AsyncLLM.shutdown() ran on the event loop's thread"
