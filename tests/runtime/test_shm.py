"""Shared memory a killed child leaves behind is released (voicebot/engines/shm.py).

A child process (spawned, as vLLM's engine core is) makes a shared-memory ring and a
lock (a named semaphore, as vLLM's executor does) and is killed before it can unlink
them. Left alone, they stay until the parent exits and multiprocessing's resource
tracker, shared with the child, warns of each kind on stderr; with
``shm.release_after`` they are gone and nothing is said. In a subprocess: the tracker
speaks as that process ends. No engine: the mechanism vLLM's processes go through.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import multiprocessing as mp, os, sys, time
from multiprocessing import shared_memory
import psutil
from voicebot.engines import shm

def hold(ready):
    ring = shared_memory.SharedMemory(create=True, size=1 << 16)
    lock = mp.get_context("spawn").Lock()  # mapped by its creator under a temporary name
    ready.set()
    time.sleep(60)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=hold, args=(ready,))
    child.start()
    assert ready.wait(60), "the child made no ring"
    proc = psutil.Process(child.pid)
    # Its own ring and lock, beside the semaphores of ``ready`` that it opened by name.
    held = shm.held([proc]) - shm.held([psutil.Process()])
    assert len(held) == 2 and {n[:4] for n in held} == {"psm_", "sem."}, held
    if sys.argv[1] == "orphan":
        # Still running when its engine's shutdown is over (a vLLM worker whose engine
        # core was killed takes seconds to notice): it is killed, and what it held released.
        assert shm.release_after([proc], held, 0.5) == sorted(held)
        assert not proc.is_running() and not any(os.path.exists("/dev/shm/" + name) for name in held)
    else:
        proc.kill()
    child.join()
    if sys.argv[1] == "release":
        assert shm.release_after([proc], held, 5.0) == sorted(held)
        assert not any(os.path.exists("/dev/shm/" + name) for name in held)
    print("done", flush=True)
"""


def run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "killed_child.py"
    script.write_text(SCRIPT)
    # communicate() reads to EOF: the resource tracker holds stderr until it has exited.
    return subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("mode", ["keep", "release", "orphan"])
def test_a_killed_childs_ring_and_lock_are_released(tmp_path: Path, mode: str) -> None:
    done = run(tmp_path, mode)
    assert done.returncode == 0 and "done" in done.stdout, done.stdout + done.stderr
    # "keep": what the tracker says of a ring and a lock left behind (the check can fail).
    for kind in ("shared_memory", "semaphore"):
        assert (f"leaked {kind}" in done.stderr) == (mode == "keep"), done.stderr
