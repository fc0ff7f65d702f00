"""LiveKit Agents glue for tests/e2e/test_clients_realtime.py: an ``AgentSession`` on
``livekit.plugins.openai.realtime.RealtimeModel(base_url=ours)`` with no LiveKit server,
the room's microphone replaced by frames the test pushes and its speaker by a sink that
plays in real time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from livekit import rtc
from livekit.agents import Agent, AgentSession
from livekit.agents.voice import io
from livekit.plugins import openai as lk_openai
from servers import RunningServer

from .harness import KEY, PCM_RATE, chunks, live_chunks


class WavInput(io.AudioInput):
    """The room's microphone, replaced: frames the test pushes, in order."""

    def __init__(self) -> None:
        super().__init__(label="wav")
        self._frames: asyncio.Queue[rtc.AudioFrame] = asyncio.Queue()

    async def __anext__(self) -> rtc.AudioFrame:
        return await self._frames.get()

    def push(self, pcm: bytes) -> None:
        for chunk in chunks(pcm, ms=20):
            self._frames.put_nowait(rtc.AudioFrame(chunk, PCM_RATE, 1, len(chunk) // 2))

    async def say(self, pcm: bytes) -> None:
        """``pcm`` as a room's microphone delivers it: a 20 ms frame every 20 ms."""
        async for chunk in live_chunks(pcm, ms=20):
            self._frames.put_nowait(rtc.AudioFrame(chunk, PCM_RATE, 1, len(chunk) // 2))


class Sink(io.AudioOutput):
    """The room's speaker, replaced: keeps the frames and 'plays' them in real time, so
    LiveKit's playback positions (what it truncates the reply to) are a real player's."""

    def __init__(self) -> None:
        super().__init__(label="sink", capabilities=io.AudioOutputCapabilities(pause=False),
                         sample_rate=PCM_RATE)
        self.frames: list[rtc.AudioFrame] = []
        self.interrupted = 0
        self._started: float | None = None
        self._pushed = 0.0  # seconds captured in the current segment
        self._finishing: asyncio.TimerHandle | None = None

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._started is None:
            self._started = time.time()
            self.on_playback_started(created_at=self._started)
        self.frames.append(frame)
        self._pushed += frame.duration

    def flush(self) -> None:
        super().flush()
        if self._started is None or self._finishing is not None:
            return
        left = self._started + self._pushed - time.time()
        self._finishing = asyncio.get_running_loop().call_later(max(0.0, left), self._finish, False)

    def clear_buffer(self) -> None:
        if self._started is not None:
            self.interrupted += 1
            self._finish(True)

    def _finish(self, interrupted: bool) -> None:
        if self._finishing is not None:
            self._finishing.cancel()
        assert self._started is not None
        position = min(time.time() - self._started, self._pushed)
        self._started, self._pushed, self._finishing = None, 0.0, None
        self.on_playback_finished(playback_position=position, interrupted=interrupted)


@contextlib.asynccontextmanager
async def agent_session(
    server: RunningServer, protocol: Literal["ga", "beta"] = "ga",
) -> AsyncIterator[tuple[AgentSession, WavInput, Sink, list[Any], list[Any]]]:
    if protocol == "ga":  # LiveKit's default
        model = lk_openai.realtime.RealtimeModel(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, model="voicebot")  # by base URL only
    else:
        # LiveKit speaks the beta protocol only in its legacy Azure mode (api_version set);
        # its Entra token goes as Authorization: Bearer, its api_key as Azure's api-key header.
        model = lk_openai.realtime.RealtimeModel.with_azure(
            azure_deployment="voicebot", base_url=f"http://127.0.0.1:{server.port}/v1/realtime",
            entra_token=KEY, api_version="2024-10-01-preview")
    # No echo to cancel in a WAV: LiveKit otherwise ignores the caller for 3 s after the
    # agent starts speaking (AEC warm-up), an app setting, not a protocol matter.
    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = WavInput(), Sink()
    session.input.audio, session.output.audio = mic, speaker
    errors: list[Any] = []
    session.on("error", errors.append)
    agent = Agent(instructions="Be brief.")
    await session.start(agent)
    # generate_reply's own generation is the one LiveKit matched by metadata.client_event_id.
    generations: list[Any] = []
    agent.realtime_llm_session.on("generation_created", generations.append)
    try:
        yield session, mic, speaker, errors, generations
    finally:
        await session.aclose()
        await model.aclose()
