"""The shared ASR service end to end: a real ``voicebot asr-serve`` process hosting
faster-whisper tiny.en, and a real frontend (``asr.backend: remote``, the test LLM, espeak)
that a native caller talks to. One call: a LibriVox clip gets its transcript and a spoken
reply; then the service is killed while the caller speaks, and the call gets an error
event instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import jiwer
import pytest
from servers import (
    FAST_SPEECH,
    OUT_RATE,
    EnginePool,
    NativeCall,
    RunningServer,
    running_server,
    service_process,
)
from speech import Clip

from voicebot.config import ModelsConfig, load_config
from voicebot.probe.base import ClientClosed

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast

ROOT = Path(__file__).resolve().parents[2]


def norm(text: str) -> str:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).strip()


@pytest.fixture(scope="module")
def asr_service(models_config: ModelsConfig, whisper_tiny_dir: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``voicebot asr-serve`` in its own process group; yields it and its URL."""
    with service_process("asr-serve", "--config", "configs/test.yaml", "--set",
                         f"models.cache_dir={models_config.cache_dir}", "--port", "0", "--no-pull") as service:
        yield service


@pytest.fixture(scope="module")
async def frontend(engine_pool: EnginePool,
    models_config: ModelsConfig, asr_service: tuple[subprocess.Popen[str], str]
) -> AsyncIterator[RunningServer]:
    cfg = load_config(
        "configs/test.yaml",
        [
            f"models.cache_dir={models_config.cache_dir}", FAST_SPEECH,
            "asr.backend=remote",
            f"asr.remote.url={asr_service[1]}",
            "asr.remote.retries=1",
            "asr.remote.retry_backoff_s=0.1",
            "asr.remote.startup_timeout_s=5",
            # The random test LLM's words are nonsense (often CJK) that espeak speaks at
            # length in real time: a few tokens keep the reply short.
            "llm.max_tokens=6",
            "server.max_sessions=2",
            "server.transports=[native]",
        ],
    )
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


async def test_a_call_through_the_shared_asr_service_then_the_service_dies_mid_call(
    frontend: RunningServer, asr_service: tuple[subprocess.Popen[str], str], speech_clips: list[Clip]
) -> None:
    proc, _ = asr_service
    clip = speech_clips[0]
    call = await NativeCall.open(frontend)
    try:
        # 1. A clip, transcribed by the service's engine, and a spoken reply.
        # Partials stream from the service while the caller speaks: the mic waits for the
        # first one two thirds into the clip (the server hears no more audio meanwhile).
        await call.say(clip.audio, pause_at_s=clip.duration_s * 2 / 3,
                       resume_when=lambda: bool(call.of("transcript.partial")))
        final = await call.wait_for("transcript.final")
        assert jiwer.wer(norm(clip.text), norm(final["text"]) or "<empty>") <= 0.15, final["text"]
        partials = call.of("transcript.partial")
        assert all(p["_t"] < final["_t"] for p in partials), "no partial after the final"
        done = await call.wait_for("response.done", timeout=90)
        assert done["status"] == "completed"
        assert call.reply_audio(done["response_id"]).size > OUT_RATE // 4, "the reply was spoken"
        assert not call.errors()

        # 2. The service is killed while the caller speaks: an error event, never a hung call.
        # Either the turn's final fails (asr_unavailable: the turn ends with nothing said)
        # or the failed decodes in a row trip the supervisor first (engine_failed: the
        # server ends the call, fatal, and closes the socket). Both within seconds.
        mark = len(call.events)
        speaking = asyncio.create_task(call.say(clip.audio))
        await asyncio.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        error = await call.wait_for("error", timeout=20, after=mark)
        assert error["code"] in ("asr_unavailable", "engine_failed"), error
        with contextlib.suppress(ClientClosed):
            await speaking
        if error["code"] == "engine_failed":
            await asyncio.wait_for(call._tasks[0], 10)  # the server closed the call
        else:
            await call.wait_for("transcript.final", timeout=20, after=mark)
    finally:
        await asyncio.wait_for(call.close(), 10)
