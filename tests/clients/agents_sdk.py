"""OpenAI Agents SDK (``openai-agents``) glue for tests/e2e/test_clients_realtime.py: a
``RealtimeAgent`` with a ``get_weather`` function tool, run by ``RealtimeRunner`` against
our server by URL only, its session events collected as they come."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agents import function_tool, set_tracing_disabled
from agents.realtime import RealtimeAgent, RealtimeRunner, RealtimeSession
from servers import RunningServer

from .harness import KEY, TIMEOUT, WireLog, chunks, live_chunks

# The SDK's trace export goes to OpenAI's servers; a self-hosted deployment turns it off.
set_tracing_disabled(True)

# What get_weather returns (with the city): a value the model cannot guess (it made up
# "sunny, 22 degrees" when it answered without calling), so an answer holding it used the
# result. JSON, not a sentence: given "It is foggy and 13 degrees in Paris." Qwen2.5-Coder-0.5B
# answered "tool_response" (the template's tag for the result, as words).
FORECAST = {"temperature_c": 13, "sky": "foggy"}
INSTRUCTIONS = ("You are a friendly voice assistant. Use the tools for weather questions, "
                "then tell the caller what the tool returned. Answer in one short sentence.")


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

    async def wait_for(self, check: Any, timeout: float = TIMEOUT, context: Any = None) -> None:
        """Poll ``check``; on a timeout, fail with ``context()`` (what was seen instead)."""
        try:
            async with asyncio.timeout(timeout):
                while not check():
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout} s: {context() if context else ''}") from None

    def transcript(self, item_id: str) -> str:
        return "".join(d.delta for d in self.raw("transcript_delta") if d.item_id == item_id)

    def transcripts(self) -> dict[str, str]:
        """Every reply item's spoken transcript so far."""
        return {d.item_id: self.transcript(d.item_id) for d in self.raw("transcript_delta")}


@contextlib.asynccontextmanager
async def agent_session(server: RunningServer, *, weather: bool = True) -> AsyncIterator[Run]:
    """A session of the agent with the get_weather tool, or (``weather=False``) of a
    plain voice agent with no tools."""
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, **FORECAST})

    if weather:
        agent = RealtimeAgent(name="Assistant", instructions=INSTRUCTIONS, tools=[get_weather])
        # Our server's tool_choice "required" forces the first reply after each user turn to
        # call a tool; the reply after a function_call_output is free to answer (docs/realtime.md).
        runner = RealtimeRunner(agent, config={"model_settings": {"tool_choice": "required"}})
    else:
        runner = RealtimeRunner(RealtimeAgent(name="Assistant", instructions="Be brief."))
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


async def say(run: Run, pcm: bytes) -> None:
    """``pcm`` as an app streaming a microphone sends it, in real time."""
    async for chunk in live_chunks(pcm, ms=20):
        await run.session.send_audio(chunk)


def no_errors(run: Run, wire: WireLog) -> None:
    assert not wire.errors(), wire.errors()
    assert not run.of("error"), [e.error for e in run.of("error")]
    # An event the SDK cannot parse reaches the app as an "exception" model event.
    assert not run.raw("exception"), [(e.context, e.exception) for e in run.raw("exception")]
