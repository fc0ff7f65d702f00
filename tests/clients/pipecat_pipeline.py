"""Pipecat glue for tests/e2e/test_clients_realtime.py: a minimal pipeline
``[tap, OpenAIRealtimeLLMService(base_url=ours), tap]`` fed speech as ``InputAudioRawFrame``s
(no transport), every frame recorded by the taps."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from pipecat.frames.frames import Frame, InputAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner
from servers import RunningServer

from .harness import KEY, PCM_RATE, chunks, live_chunks


class Tap(FrameProcessor):
    """Records every frame that passes, either way, and passes it on."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.frames: list[Frame] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        self.frames.append(frame)
        await self.push_frame(frame, direction)

    def of(self, kind: type) -> list[Any]:
        return [f for f in self.frames if isinstance(f, kind)]


async def feed(worker: PipelineWorker, pcm: bytes) -> None:
    for chunk in chunks(pcm):
        await worker.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=PCM_RATE, num_channels=1))
        await asyncio.sleep(0.01)


async def feed_live(worker: PipelineWorker, pcm: bytes) -> None:
    """``pcm`` as a transport's microphone delivers it, in real time."""
    async for chunk in live_chunks(pcm, ms=20):
        await worker.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=PCM_RATE, num_channels=1))


@contextlib.asynccontextmanager
async def pipeline(server: RunningServer) -> AsyncIterator[tuple[PipelineWorker, Tap, Tap]]:
    llm = OpenAIRealtimeLLMService(
        api_key=KEY,
        base_url=f"ws://127.0.0.1:{server.port}/v1/realtime",  # the one setting that points it at us
        settings=OpenAIRealtimeLLMService.Settings(model="voicebot", system_instruction="Be brief."),
    )
    up, down = Tap("up"), Tap("down")
    worker = PipelineWorker(
        Pipeline([up, llm, down]),
        params=PipelineParams(audio_in_sample_rate=PCM_RATE, audio_out_sample_rate=PCM_RATE),
        idle_timeout_secs=None,
        enable_rtvi=False,
    )
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    task = asyncio.create_task(runner.run())
    try:
        yield worker, up, down
    finally:
        await worker.cancel()
        async with asyncio.timeout(30):
            await task
