"""A vLLM engine's processes leave no shared memory behind, however they end.

vLLM's engine core and its worker talk through shared-memory rings, each unlinked by its
creator when it exits normally. A start-up aborted while loading (Ctrl-C, SIGTERM, a
failed sibling engine) kills them at once (voicebot/engines/startup.py); vLLM's own
shutdown force-kills an engine core that outlives its grace. Their rings then stayed
until the process exited, and multiprocessing's resource tracker said so on stderr:
"resource_tracker: There appear to be 2 leaked shared_memory objects to clean up at
shutdown", and "1 leaked semaphore objects" for the lock vLLM's executor makes in the
engine core. Run in a subprocess, whose stderr the resource tracker shares: the warning is
printed as the process ends, after anything a test in this process could check.
A full start then a close (the SIGTERM path of a whole server) is checked the same way,
on the server's own stderr, by tests/e2e/test_lifecycle.py: this module starts vLLM
only for the start it aborts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from voicebot.config import ModelsConfig

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[2]

# An in-process LLM start (configs/test.yaml) aborted once vLLM's processes hold their rings.
SCRIPT = """
import asyncio, sys
import psutil
from voicebot.config import load_config
from voicebot.engines import shm
from voicebot.engines.registry import create_llm
from voicebot.engines.startup import start_all
from voicebot.provision import resolve_model

async def main() -> None:
    cfg = load_config("configs/test.yaml", [f"models.cache_dir={sys.argv[1]}", "models.offline=true"])
    path = resolve_model(cfg.llm.model, cfg.models, pull=False)
    start = asyncio.ensure_future(start_all({"llm": create_llm(cfg.llm, path)}))
    me = psutil.Process()
    while not shm.mapped(me.children(recursive=True)):
        assert not start.done(), "the start ended before vLLM made a shared-memory ring"
        await asyncio.sleep(0.05)
    start.cancel()
    await asyncio.wait([start])
    print("aborted a start holding rings", flush=True)

asyncio.run(main())
"""


def test_an_aborted_start_leaves_no_shared_memory_segment(models_config: ModelsConfig) -> None:
    # communicate() reads to EOF: the resource tracker holds stderr until it has exited.
    done = subprocess.run([sys.executable, "-c", SCRIPT, models_config.cache_dir], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "aborted a start holding rings" in done.stdout, out[-4000:]
    # Its rings are never reported leaked. Its executor's lock (a named semaphore) is
    # released only when it exists when the engine's processes are listed before the
    # kill: an abort this early can come first, and then "1 leaked semaphore objects"
    # is printed (docs/reliability.md), so this checks the rings only.
    leaks = [line for line in done.stderr.splitlines() if "leaked shared_memory" in line]
    assert not leaks, "\n".join(leaks)
