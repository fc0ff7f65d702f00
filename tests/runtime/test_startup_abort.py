"""Ctrl-C while the engines load: no "Task exception was never retrieved".

Found trying the server as a new user would: `voicebot serve` (configs/default.yaml), and
SIGINT 15 s after start while vLLM was loading. The process exited 0 in 3 s, but logged at
ERROR

    ERROR asyncio: Task exception was never retrieved
    future: <Task finished name='start-llm' ... exception=ModelError("vLLM could not load
    .../qwen2.5-coder-0.5b-instruct: Engine core initialization failed ... {'EngineCore': -9}")>
    Traceback ...

i.e. a traceback that says the model could not load, when the user only pressed Ctrl-C.
The abort (voicebot/engines/startup.py ``_undo``) kills the engine core, the start then
fails as expected, and nobody read that task's exception. Same for a second engine that
fails while the first failure is being handled. Fakes of our own ``Startable`` interface.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

from voicebot.engines.startup import start_all
from voicebot.errors import ModelError


class AbortedBuild:
    """A start whose build thread fails once it is aborted (vLLM after its core is killed)."""

    def __init__(self) -> None:
        self.closed = False

    async def start(self, cancel: threading.Event) -> None:
        def build() -> None:
            cancel.wait(5.0)
            raise ModelError("could not load: Engine core initialization failed")

        await asyncio.to_thread(build)

    async def aclose(self) -> None:
        self.closed = True


class QuickStart:
    async def start(self) -> None:
        await asyncio.sleep(0)

    async def aclose(self) -> None:
        pass


async def test_aborting_a_start_reports_no_unretrieved_task_exception() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        llm = AbortedBuild()
        task = asyncio.create_task(start_all({"llm": llm, "tts": QuickStart()}))
        await asyncio.sleep(0.2)
        task.cancel()  # what a SIGINT during start-up does (lifespan cancels the loader)
        with pytest.raises(asyncio.CancelledError):
            await task
        del task
        assert llm.closed
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    messages = [f"{c.get('message')}: {c.get('exception')!r}" for c in reported]
    assert messages == [], "the abort left a task exception for asyncio to report at ERROR"
