"""The shared TTS service end to end: a real ``voicebot tts-serve`` process hosting Piper
(the default config's voice), and a real frontend (``tts.backend: remote``, whisper tiny.en,
the test LLM) that a native caller talks to. A call gets its reply spoken through the
service; a clause closed after its first sentence stops being synthesised there; the
service (a process of that test's own) is killed mid-clause and then before a reply, and
each time an error comes instead of a hang; a bad service config is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
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

from voicebot.config import ModelsConfig, TtsConfig, load_config
from voicebot.engines.tts.remote import RemoteTts
from voicebot.errors import EngineError

ROOT = Path(__file__).resolve().parents[2]
VOICE = "bundle:piper-en_US-joe-medium"  # configs/default.yaml's
LONG = " ".join(f"This is sentence number {n} of a reply that goes on for a while." for n in range(1, 13))

pytestmark = pytest.mark.engines


def serve_args(models_config: ModelsConfig, *sets: str) -> list[str]:
    """``voicebot tts-serve``'s arguments: Piper, any free port, the suite's model cache."""
    args = ["--config", "configs/test.yaml", "--set", f"models.cache_dir={models_config.cache_dir}",
            "--set", "tts.engine=piper", "--set", f"tts.voice={VOICE}", "--port", "0", "--no-pull"]
    for item in sets:
        args += ["--set", item]
    return args


@pytest.fixture(scope="module")
def piper_voice(bundle_dir: Any) -> str:
    return str(bundle_dir(VOICE.removeprefix("bundle:")))


@contextlib.contextmanager
def started_service(models_config: ModelsConfig) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``voicebot tts-serve`` (Piper) in its own process group; yields it and its URL."""
    with service_process("tts-serve", *serve_args(models_config)) as service:
        yield service


@pytest.fixture(scope="module")
def tts_service(models_config: ModelsConfig, piper_voice: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The service the tests share (none of them stops it)."""
    with started_service(models_config) as service:
        yield service


@pytest.fixture
def doomed_service(models_config: ModelsConfig, piper_voice: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A service of its own for the test that kills it (the shared one stays up for the others)."""
    with started_service(models_config) as service:
        yield service


@pytest.fixture
async def frontend(engine_pool: EnginePool,
    models_config: ModelsConfig, doomed_service: tuple[subprocess.Popen[str], str]
) -> AsyncIterator[RunningServer]:
    """A server speaking through ``doomed_service``."""
    cfg = load_config(
        "configs/test.yaml",
        [
            f"models.cache_dir={models_config.cache_dir}", FAST_SPEECH,
            "tts.engine=piper",
            f"tts.voice={VOICE}",
            "tts.backend=remote",
            f"tts.remote.url={doomed_service[1]}",
            "tts.remote.retries=1",
            "tts.remote.retry_backoff_s=0.1",
            "tts.remote.startup_timeout_s=5",
            "llm.max_tokens=6",  # the random test LLM's words: a short reply (spoken in real time)
            "server.max_sessions=2",
            "server.transports=[native]",
        ],
    )
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


async def service_stats(url: str) -> dict[str, Any]:
    async with websockets.connect(url) as ws:
        await asyncio.wait_for(ws.recv(), 30)  # hello
        await ws.send(json.dumps({"type": "stats"}))
        return dict(json.loads(await asyncio.wait_for(ws.recv(), 30)))


async def stats_until(url: str, cond: Any, timeout: float = 30.0) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while not cond(stats := await service_stats(url)):
            await asyncio.sleep(0.05)
    return stats


def client(url: str) -> RemoteTts:
    cfg = TtsConfig(backend="remote", remote={"url": url, "retries": 0, "startup_timeout_s": 10})  # type: ignore[arg-type]
    return RemoteTts(cfg)


async def test_a_call_spoken_through_the_service_then_the_service_dies(
    frontend: RunningServer, doomed_service: tuple[subprocess.Popen[str], str], speech_clips: list[Clip]
) -> None:
    proc, url = doomed_service
    clip = min(speech_clips, key=lambda c: c.audio.size)  # the turn's length is real time
    call = await NativeCall.open(frontend)
    try:
        # 1. A reply synthesised by the service's Piper and spoken to the caller.
        done = await call.turn(clip.audio, timeout=90)
        assert done["status"] == "completed", done
        assert call.reply_audio(done["response_id"]).size > OUT_RATE // 4, "the reply was spoken"
        assert not call.errors()
        stats = await service_stats(url)
        assert stats["clauses"] >= 1 and stats["chunks"] >= 1

        # 2. The service is killed while a clause streams: the clause fails, it does not hang.
        tts = client(url)
        await tts.start()
        try:
            async with contextlib.aclosing(tts.synthesize(LONG)) as stream:
                await asyncio.wait_for(anext(stream), 60)
                os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 10)  # not on the loop: the frontend runs on it
                with pytest.raises(EngineError) as info:  # after at most the one chunk already here
                    for _ in range(12):
                        await asyncio.wait_for(anext(stream), 30)
            assert info.value.code == "tts_unavailable"
        finally:
            await tts.aclose()

        # 3. The next reply of the call: an error event and a failed reply, and the call goes on.
        mark = len(call.events)
        await call.say(clip.audio)
        error = await call.wait_for("error", timeout=90, after=mark)
        assert error["code"] == "tts_unavailable", error
        failed = await call.wait_for("response.done", timeout=30, after=mark)
        assert failed["status"] == "failed", failed
    finally:
        await asyncio.wait_for(call.close(), 10)


# Runs after the test that kills its own service: the shared one is still up.
async def test_closing_a_clause_after_its_first_sentence_stops_its_synthesis_on_the_service(
    tts_service: tuple[subprocess.Popen[str], str],
) -> None:
    url = tts_service[1]
    tts = client(url)
    await tts.start()
    try:
        assert tts.sample_rate == 22_050  # Piper joe-medium's, from the service's hello
        before = await service_stats(url)
        async with contextlib.aclosing(tts.synthesize(LONG)) as stream:
            first = await asyncio.wait_for(anext(stream), 60)
            assert first.size > tts.sample_rate  # a whole spoken sentence
        after = await stats_until(url, lambda s: s["running"] == 0 and s["engine_queue_depth"] == 0)
        assert after["cancelled"] == before["cancelled"] + 1
        assert after["clauses"] == before["clauses"], "the clause was not synthesised to its end"
        # window 1: the sentence taken and at most the next one were sent, of twelve
        assert after["chunks"] - before["chunks"] <= 2
    finally:
        await tts.aclose()


def test_tts_serve_refuses_a_bad_config(models_config: ModelsConfig) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "voicebot", "tts-serve", *serve_args(models_config, "tts.remote.window=0")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "tts.remote.window" in proc.stderr
