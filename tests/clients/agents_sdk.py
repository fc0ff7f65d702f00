"""OpenAI Agents SDK (``openai-agents``) glue for tests/test_clients_realtime.py: a
``RealtimeAgent`` with a ``get_weather`` function tool, run by ``RealtimeRunner`` against
our server by URL only, its session events collected as they come."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agents import function_tool, set_tracing_disabled
from agents.realtime import RealtimeAgent, RealtimeRunner, RealtimeSession
from servers import RunningServer

from .harness import KEY, TIMEOUT, WireLog, chunks

# The SDK's trace export goes to OpenAI's servers; a self-hosted deployment turns it off.
set_tracing_disabled(True)

FORECAST = "sunny and 22 degrees"


@dataclass
class Run:
    """One RealtimeSession and everything it emitted, collected in the background."""

    session: RealtimeSession
    events: list[Any] = field(default_factory=list)
    tool_calls: list[str] = field(default_factory=list)

    def of(self, kind: str) -> list[Any]:
        return [e for e in self.events if e.type == kind]

    def raw(self, kind: str) -> list[Any]:
        """The SDK's own model events of ``kind`` (errors, exceptions, transcripts...)."""
        return [e.data for e in self.of("raw_model_event") if e.data.type == kind]

    async def wait_for(self, check: Any, timeout: float = TIMEOUT) -> None:
        async with asyncio.timeout(timeout):
            while not check():
                await asyncio.sleep(0.05)

    def transcript(self, item_id: str) -> str:
        return "".join(d.delta for d in self.raw("transcript_delta") if d.item_id == item_id)


@contextlib.asynccontextmanager
async def agent_session(server: RunningServer) -> AsyncIterator[Run]:
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is {FORECAST} in {city}."

    agent = RealtimeAgent(
        name="Assistant",
        instructions="You are a voice assistant. For any weather question, call get_weather. "
                     "Answer in one short sentence.",
        tools=[get_weather],
    )
    runner = RealtimeRunner(agent)
    # Pointed at our server by URL and key, as a user of the SDK does.
    session = await runner.run(model_config={
        "url": f"ws://127.0.0.1:{server.port}/v1/realtime?model=voicebot", "api_key": KEY})
    async with session:
        run = Run(session, tool_calls=calls)

        async def collect() -> None:
            async for event in session:
                run.events.append(event)

        task = asyncio.create_task(collect())
        try:
            yield run
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def send_speech(run: Run, pcm: bytes) -> None:
    for chunk in chunks(pcm):
        await run.session.send_audio(chunk)
        await asyncio.sleep(0.01)  # ~10x real time: a client streaming a WAV


def no_errors(run: Run, wire: WireLog) -> None:
    assert not wire.errors(), wire.errors()
    assert not run.of("error"), [e.error for e in run.of("error")]
    # An event the SDK cannot parse reaches the app as an "exception" model event.
    assert not run.raw("exception"), [(e.context, e.exception) for e in run.raw("exception")]
