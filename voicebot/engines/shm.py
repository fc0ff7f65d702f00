"""Shared memory that an engine's processes leave behind when they are killed.

vLLM's processes (the engine core, its workers) talk through POSIX shared-memory rings
(``multiprocessing.shared_memory``: ``/dev/shm/psm_*``), each unlinked by the process
that created it when that process exits normally. A process killed first leaves its
rings behind: vLLM force-kills an engine core that outlives its shutdown grace (its
CPU build often does), and an aborted start-up kills the engine processes at once
(voicebot/engines/startup.py). The memory then stays taken until this process exits,
when multiprocessing's resource tracker (which the children share) unlinks it and warns
"There appear to be N leaked shared_memory objects to clean up at shutdown"; a server
whose engine restarts keeps each restart's rings until then.

So the rings an engine's processes map are listed while those run (:func:`mapped`), and
released once they are gone (:func:`release`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from multiprocessing import shared_memory

import psutil

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm/"
_PREFIX = "psm_"  # multiprocessing.shared_memory's names


def tree(pids: Iterable[int]) -> list[psutil.Process]:
    """These processes and their descendants (those still running)."""
    found: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            found.append(p)
            found.extend(p.children(recursive=True))
    return found


def mapped(procs: Iterable[psutil.Process]) -> set[str]:
    """The shared-memory segments these processes map and nobody has unlinked yet."""
    names: set[str] = set()
    for p in procs:
        try:
            maps = p.memory_maps(grouped=True)
        except psutil.Error:
            continue
        for m in maps:
            path = m.path
            if path.startswith(_SHM_DIR + _PREFIX) and not path.endswith("(deleted)"):
                names.add(path.removeprefix(_SHM_DIR))
    return names


def release_after(procs: list[psutil.Process], names: set[str], timeout_s: float) -> list[str]:
    """Once ``procs`` have exited (at most ``timeout_s``), release what they left of
    ``names``. If one still runs, nothing: a live process unlinks its own at its exit
    (and would complain of a ring unlinked under it)."""
    if not names:
        return []
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    if alive:
        log.debug("engine processes %s still running: their shared memory is left to them",
                  [p.pid for p in alive])
        return []
    return release(names)


def release(names: Iterable[str]) -> list[str]:
    """Unlink the segments of ``names`` that are still there, and tell the resource
    tracker (``SharedMemory.unlink``); returns those released."""
    released = []
    for name in sorted(names):
        try:
            segment = shared_memory.SharedMemory(name=name)
        except OSError:  # FileNotFoundError: its creator released it after all
            continue
        segment.close()
        with contextlib.suppress(OSError):
            segment.unlink()
            released.append(name)
    if released:
        log.info("released %d shared-memory segment(s) of killed engine processes", len(released))
    return released
