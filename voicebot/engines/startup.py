"""Starting engines together, and undoing a start that fails or is cancelled.

:func:`start_all` starts several engines at once. If one fails, or the caller is
cancelled (a shutdown while loading), no engine is left running: the ones still
starting are aborted and waited for, then every engine is closed.

Why aborting needs more than a task cancel: engines build their models in worker
threads (``asyncio.to_thread``), and cancelling the awaiting task does not stop a
thread. An LLM start takes a ``cancel`` event that its build checks between steps,
but most of the build is one step, vLLM's ``AsyncLLM.from_engine_args``, waiting for
the engine-core child process it spawned; killing that child makes the build fail
within a moment (vLLM notices the process is gone and raises), so the thread ends
and nothing is leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import multiprocessing
import os
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol

import psutil

from voicebot.engines import shm

log = logging.getLogger(__name__)

# How long an aborted start may take to wind down before we stop waiting for it.
# vLLM fails within a second of its engine-core process being killed; the other
# builds (a Whisper or Piper load) take a second or two and cannot be interrupted.
ABORT_WAIT_S = 20.0
_POLL_S = 0.05


class Startable(Protocol):
    async def start(self) -> None:
        """May take ``cancel: threading.Event``: set when the start is aborted."""


    async def aclose(self) -> None: ...


class EngineProcesses:
    """Engine child processes (vLLM's engine core) started after this snapshot was taken."""

    def __init__(self) -> None:
        self._me = psutil.Process(os.getpid())
        self._before = {p.pid for p in self._me.children()}
        try:
            self._cmdline = self._me.cmdline()
        except psutil.Error:  # pragma: no cover - our own /proc entry
            self._cmdline = []

    def new(self) -> list[psutil.Process]:
        found = []
        for p in self._me.children():
            if p.pid not in self._before and self._is_engine(p):
                found.append(p)
        return found

    def _is_engine(self, p: psutil.Process) -> bool:
        # Positive identification only: a TTS start runs short espeak-ng children at
        # the same time, and multiprocessing's resource tracker is shared by everyone.
        try:
            name, cmdline = p.name(), p.cmdline()
        except psutil.Error:
            return False
        joined = " ".join(cmdline)
        if "resource_tracker" in joined:
            return False
        return (
            name.startswith("VLLM")  # vLLM's process title, once the child has set it
            or "spawn_main" in joined  # a multiprocessing spawn/forkserver child
            or (bool(cmdline) and cmdline == self._cmdline)  # a fork of this process
        )

    def kill_new(self) -> int:
        """SIGKILL every new engine process and its descendants, and release the shared
        memory they had not unlinked yet (voicebot/engines/shm.py); return how many."""
        victims = []
        for p in self.new():
            with contextlib.suppress(psutil.Error):
                victims.extend(p.children(recursive=True))
            victims.append(p)
        rings = shm.held(victims)
        for p in victims:
            try:
                p.kill()
            except psutil.Error:
                continue
            log.warning("aborting an engine start: killed engine process %d", p.pid)
        shm.release_after(victims, rings, 2.0)  # SIGKILL is not instant
        return len(victims)


async def start_all(engines: Mapping[str, Startable], *, abort_wait_s: float = ABORT_WAIT_S) -> None:
    """Start ``engines`` concurrently; all or nothing.

    On the first failure, or when cancelled, the starts still running are aborted and
    awaited (at most ``abort_wait_s``), every engine is closed, and the error (or the
    CancelledError) is raised.
    """
    procs = EngineProcesses()
    cancel = threading.Event()
    tasks = {name: asyncio.create_task(_start(e, cancel), name=f"start-{name}") for name, e in engines.items()}
    try:
        # asyncio.wait, not gather: cancelling the waiter leaves the starts running, so
        # the undo below can see how each of them ends.
        done, pending = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in done if not t.cancelled() and t.exception() is not None), None)
        if failed is None and not pending:
            return
        assert failed is not None
        error: BaseException = failed.exception()  # type: ignore[assignment]
        log.error("%s failed to start: %s", failed.get_name().removeprefix("start-"), error)
    except asyncio.CancelledError:
        error = asyncio.CancelledError()
        log.info("engine start cancelled: aborting the starts still running")
    cancel.set()  # a build between two steps stops at the next one
    undo = asyncio.create_task(_undo(engines, tasks, procs, abort_wait_s), name="engine-start-undo")
    try:
        await asyncio.shield(undo)
    except asyncio.CancelledError:
        await asyncio.wait([undo])  # cancelled again: the engines must still be closed
        raise
    if isinstance(error, asyncio.CancelledError):
        raise asyncio.CancelledError
    raise error


def _start(engine: Startable, cancel: threading.Event) -> Coroutine[Any, Any, None]:
    # An engine whose build runs in a thread (the LLM) takes the abort flag; a start
    # that only awaits is stopped by the process kill or simply waited for.
    if "cancel" in inspect.signature(engine.start).parameters:
        return engine.start(cancel=cancel)  # type: ignore[call-arg]
    return engine.start()


async def _undo(
    engines: Mapping[str, Startable],
    tasks: dict[str, asyncio.Task[None]],
    procs: EngineProcesses,
    abort_wait_s: float,
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + abort_wait_s
    pending = {t for t in tasks.values() if not t.done()}
    while pending and loop.time() < deadline:
        # Each round, since vLLM may spawn its engine core only after its imports.
        procs.kill_new()
        _, pending = await asyncio.wait(pending, timeout=_POLL_S)
    for name, task in tasks.items():
        if not task.done():
            # Its thread goes on; whatever it builds is unreachable. Say so loudly.
            log.error("%s still starting %.0f s after the abort; leaving it", name, abort_wait_s)
            task.cancel()
            continue
        if not task.cancelled() and (exc := task.exception()) is not None:
            # Read here: an aborted start fails by design (its engine core was killed),
            # and an unread task exception is logged by asyncio at ERROR with a traceback
            # saying the model could not load, when the user only pressed Ctrl-C.
            log.debug("%s start ended by the abort: %s", name, exc)
        # Close failed starts too: a start that failed half-way (threads up, model not
        # loaded) still holds what it opened. Every aclose is safe on an unstarted engine.
        try:
            await engines[name].aclose()
        except Exception:
            log.exception("closing %s after a failed start", name)
    procs.kill_new()  # anything an aborted build spawned after all
    await reap_children(1.0)


async def reap_children(timeout_s: float = 3.0) -> None:
    """Wait (at most ``timeout_s``) for closed engines' processes to exit, and collect them.

    vLLM force-kills an engine core that outlives its shutdown grace but never waits for
    it, which leaves a zombie per closed engine; ``multiprocessing.active_children()``
    collects the ones that have exited. A vLLM engine still in use (the vLLM ASR backend
    while the LLM restarts) keeps its engine core: then this waits out the timeout,
    which is why callers that may have one pass a short one.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while [p for p in multiprocessing.active_children() if p.name.startswith("EngineCore")]:
        if loop.time() >= deadline:
            log.debug("an engine-core process is still running %.1f s after an engine closed", timeout_s)
            return
        await asyncio.sleep(_POLL_S)
