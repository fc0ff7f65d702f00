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

The same goes for the named semaphores of their locks (``/dev/shm/sem.mp-*``: vLLM's
executor makes a ``multiprocessing.Lock`` in the engine core), which the tracker then
reports as "N leaked semaphore objects". A process maps a semaphore it created under
glibc's temporary name (``sem.XXXXXX``, linked to its real name and unlinked), so they
are found by inode: the ``sem.mp-*`` file with the inode of a ``sem.*`` mapping.

So what an engine's processes hold is listed while they run (:func:`held`: segments and
semaphores), and released once they are gone (:func:`release_after`, which kills those
that outlive their engine), except what this process maps itself.
"""

from __future__ import annotations

import _multiprocessing
import contextlib
import logging
import os
from collections.abc import Iterable
from multiprocessing import resource_tracker, shared_memory

import psutil

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm/"
_SEGMENT = "psm_"  # multiprocessing.shared_memory's names
_SEMAPHORE = "sem.mp-"  # multiprocessing's named semaphores (locks), as files in /dev/shm


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


def semaphores(procs: Iterable[psutil.Process]) -> set[str]:
    """The named semaphores these processes map that nobody has unlinked yet, as their
    file names (``sem.mp-*``), however each process opened them."""
    inodes: set[int] = set()
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/maps", encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            # address perms offset device inode path
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(_SHM_DIR + "sem.") and fields[4].isdigit():
                inodes.add(int(fields[4]))
    if not inodes:
        return set()
    names: set[str] = set()
    with contextlib.suppress(OSError), os.scandir(_SHM_DIR) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.name.startswith(_SEMAPHORE) and entry.inode() in inodes:
                    names.add(entry.name)
    return names


def held(procs: Iterable[psutil.Process]) -> set[str]:
    """What these processes hold in /dev/shm: segments (``psm_*``) and semaphores
    (``sem.mp-*``)."""
    procs = list(procs)
    return mapped(procs) | semaphores(procs)


def release_after(procs: list[psutil.Process], names: set[str], timeout_s: float) -> list[str]:
    """Once ``procs`` have exited, release what they left of ``names`` (not what this
    process maps itself). They are processes that should be gone: those still running
    after ``timeout_s`` are killed first. A vLLM worker whose engine core was killed
    exits on its own once it notices, which took over 5 s on a loaded machine; left to
    it, the core's rings (which the worker maps but did not make) stayed until the
    server's exit."""
    if not names:
        return []
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
            log.warning("engine process %d still running after its engine's shutdown: killed", p.pid)
    if alive:
        _, alive = psutil.wait_procs(alive, timeout=5.0)
    if alive:  # not even SIGKILL (uninterruptible sleep): it unlinks its own, if it can
        log.warning("engine processes %s survived SIGKILL: their shared memory is left to them",
                    [p.pid for p in alive])
        return []
    return release(names - held([psutil.Process()]))


def release(names: Iterable[str]) -> list[str]:
    """Unlink the segments and semaphores of ``names`` that are still there, and tell
    the resource tracker (which would otherwise warn of them at exit); returns those
    released."""
    released = []
    for name in sorted(names):
        try:
            if name.startswith(_SEMAPHORE):
                sem = "/" + name.removeprefix("sem.")  # the name it was made with
                _multiprocessing.sem_unlink(sem)
                resource_tracker.unregister(sem, "semaphore")
            else:
                segment = shared_memory.SharedMemory(name=name)
                segment.close()
                segment.unlink()  # and unregisters it
        except OSError:  # FileNotFoundError: its creator released it after all
            continue
        released.append(name)
    if released:
        log.info("released %d shared-memory segment(s) and semaphore(s) of killed engine processes", len(released))
    return released
