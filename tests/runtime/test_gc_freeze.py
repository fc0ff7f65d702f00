"""The loaded heap frozen out of the garbage collector (voicebot/runtime/gc_freeze.py).
That a real server freezes its engines before the first call: tests/e2e/test_voice_loop.py."""

from __future__ import annotations

import gc
import weakref

from voicebot.runtime.gc_freeze import frozen_heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_garbage_is_collected_before_the_freeze_and_the_heap_unfrozen_after() -> None:
    held = gc.get_freeze_count()
    gc.unfreeze()  # an earlier module's server may have left its heap frozen
    try:
        kept = Cycle()
        dropped = weakref.ref(Cycle())  # a cycle nothing refers to: only a collection frees it
        with frozen_heap() as frozen:
            # Garbage frozen would stay for good: the freeze collects first.
            assert dropped() is None, "a garbage cycle was frozen"
            assert frozen > 0 and gc.get_freeze_count() > 0
            assert not any(o is kept for o in gc.get_objects()), "what exists is frozen"
        # The exit's collection must reach what was frozen (vLLM's AsyncLLM cycle).
        assert gc.get_freeze_count() == 0
        assert any(o is kept for o in gc.get_objects())
    finally:
        if held:
            gc.freeze()
