"""Keep what the models loaded out of Python's cycle collector while calls are served.

Loading the engines leaves hundreds of thousands of objects tracked by the garbage
collector (torch's, transformers' and vLLM's modules and the engines' own). A full
collection walks every one of them, for a good part of a second in the CPU default
(docs/benchmarks.md, 'What the event loop pays'), on whichever thread set it off and holding the GIL, so the event loop and every call
stall with it. CPython starts one when the objects promoted since the last exceed a
quarter of the long-lived ones: rarely, but a server that runs for days does. None of
those objects ever becomes garbage. vLLM's own server freezes them after its start-up
for the same reason (``vllm.utils.gc_utils.freeze_gc_heap``).

``gc.freeze()`` moves every tracked object to a permanent generation that collections
skip. It is done once the engines are up and before the first call: a frozen object
that later ends up in a garbage cycle is never collected, so a call's own objects must
not be frozen. At exit the heap is unfrozen, so the final collection still reaches
vLLM's AsyncLLM (a reference cycle that must go while the interpreter is whole).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)


def freeze_loaded_heap() -> int:
    """Collect what loading left as garbage, then freeze the rest; returns how many
    objects were frozen. Call with no call open."""
    t0 = time.perf_counter()
    gc.collect()  # garbage frozen would stay for good
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d objects of the loaded engines out of the garbage collector (%.0f ms)",
             frozen, (time.perf_counter() - t0) * 1000)
    return frozen


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """Freeze the loaded heap while inside (see the module's docstring); unfreeze after."""
    try:
        yield freeze_loaded_heap()
    finally:
        gc.unfreeze()
