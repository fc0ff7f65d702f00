"""Shared memory that an engine's processes leave behind when they are killed.

vLLM's processes (the engine core, its workers) talk through POSIX shared-memory rings
(``multiprocessing.shared_memory``: ``/dev/shm/psm_*``), each unlinked by the process
that created it when that process exits normally. A process killed first leaves its
rings behind: vLLM force-kills an engine core still running after its 5 s shutdown
grace, and an aborted start-up kills the engine processes at once
(voicebot/engines/startup.py). The memory then stays taken until this process exits,
when multiprocessing's resource tracker (which the children share) unlinks it and warns
"There appear to be N leaked shared_memory objects to clean up at shutdown"; a server
whose engine restarts keeps each restart's rings until then.

So the segments an engine's processes map are listed while they run (:func:`mapped`),
and released once they are gone (:func:`release_after`), except those this process maps
itself. (Their locks' named semaphores, ``/dev/shm/sem.mp-*``, cannot be told apart so:
a process maps the ones it opened by name, i.e. another process's, not its own.)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from multiprocessing import shared_memory

import psutil

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm/"
_SEGMENT = "psm_"  # multiprocessing.shared_memory's names


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
    """The shared-memory segments these processes map that nobody has unlinked yet."""
    names: set[str] = set()
    for p in procs:
        try:
            maps = p.memory_maps(grouped=True)
        except psutil.Error:
            continue
        for m in maps:
            name = m.path.removeprefix(_SHM_DIR)
            if name != m.path and name.startswith(_SEGMENT) and not name.endswith("(deleted)"):
                names.add(name)
    return names


def release_after(procs: list[psutil.Process], names: set[str], timeout_s: float) -> list[str]:
    """Once ``procs`` have exited (at most ``timeout_s``), release what they left of
    ``names``. If one still runs, nothing: a live process unlinks its own at its exit
    (and would complain of one unlinked under it); nor what this process maps."""
    if not names:
        return []
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    if alive:
        log.debug("engine processes %s still running: their shared memory is left to them",
                  [p.pid for p in alive])
        return []
    return release(names - mapped([psutil.Process()]))


def release(names: Iterable[str]) -> list[str]:
    """Unlink the segments of ``names`` that are still there, and tell the resource
    tracker (which would otherwise warn of them at exit); returns those released."""
    released = []
    for name in sorted(names):
        try:
            segment = shared_memory.SharedMemory(name=name)
            segment.close()
            segment.unlink()  # and unregisters it
        except OSError:  # FileNotFoundError: its creator released it after all
            continue
        released.append(name)
    if released:
        log.info("released %d shared-memory segment(s) of killed engine processes", len(released))
    return released
