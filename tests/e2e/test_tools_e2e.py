"""Function tools end to end: real server, real engines, the CPU default LLM.

The LLM is the offline bundle's Qwen2.5-Coder-0.5B-Instruct (the random test model cannot
pick a tool from a question); speech in and out is Piper, ASR is whisper-tiny. One
server serves both tests:

- Realtime (client-side tool, through the openai SDK): a spoken "what's the weather
  in Paris?" with a get_weather tool gives a function_call item whose JSON arguments
  name Paris; the client sends the result; the spoken answer uses it, and its prompt
  came from the prefix cache.
- native /ws (server-side tool): the server calls a local webhook itself, says its
  filler while the slow webhook runs, and speaks the answer from the webhook's result.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import websockets
from aiohttp import web
from clients.harness import chunks, pcm24k, speak
from openai import AsyncOpenAI
from servers import (
    EnginePool,
    RunningServer,
    cpu_default_llm,
    running_server,
    serve_routes,
    server_errors,
)

from voicebot.config import ModelsConfig, ServerToolConfig, load_config

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast

KEY = "sk-test-tools"
TIMEOUT = 90.0  # one exchange on the shared 2-core CPU
SYSTEM = "You are a friendly voice assistant. Answer in one short sentence. Use the tools for weather questions."
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                  "required": ["city"]}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
                "parameters": WEATHER_SCHEMA}
WEBHOOK_DELAY_S = 1.5  # longer than tools.filler_after_ms: the caller hears the filler


@dataclass
class Webhook:
    url: str
    calls: list[dict[str, Any]]


@pytest.fixture(scope="module")
async def webhook() -> AsyncIterator[Webhook]:
    calls: list[dict[str, Any]] = []

    async def weather(request: web.Request) -> web.Response:
        calls.append(await request.json())
        await asyncio.sleep(WEBHOOK_DELAY_S)
        return web.json_response({"temperature_c": 17, "sky": "cloudy"})

    async with serve_routes([web.post("/weather", weather)]) as base:
        yield Webhook(f"{base}/weather", calls)


@pytest.fixture(scope="module")
async def server(engine_pool: EnginePool, models_config: ModelsConfig, webhook: Webhook) -> AsyncIterator[RunningServer]:
    cfg = load_config("configs/test.yaml", [
        f"models.cache_dir={models_config.cache_dir}",
        "tts.engine=piper",
        "tts.voice=bundle:piper-en_US-joe-medium",
        # Piper samples noise: the same question spoken twice differs, and whisper-tiny
        # heard "Paris" as "pairs" in 1 of 8 takes. Without it, one take, always heard.
        "tts.piper_noise_scale=0.0",
        "tts.piper_noise_w=0.0",
        f"server.api_key={KEY}",
        "server.input_burst_ms=60000",  # the question is uploaded faster than real time
        "server.transports=[native,realtime]",
        "tools.filler_after_ms=300",
    ])
    cfg.llm = cpu_default_llm(max_tokens=48)
    cfg.tools.server = [ServerToolConfig(name="get_weather", description=WEATHER_TOOL["description"],
                                         parameters=WEATHER_SCHEMA, url=webhook.url, timeout_s=20)]
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


def kind(event: Any) -> str:
    return str(event.type)


async def until(conn: Any, events: list[Any], *kinds: str) -> Any:
    async with asyncio.timeout(TIMEOUT):
        while True:
            event = await conn.recv()
            events.append(event)
            if kind(event) in kinds:
                return event


async def test_realtime_client_tool_spoken_question_result_and_answer(server: RunningServer) -> None:
    client = AsyncOpenAI(api_key=KEY, base_url=f"{server.http}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")
    question = await speak(server.state, "What's the weather in Paris?")
    with server_errors() as errors:
        async with client.realtime.connect(model="gpt-realtime") as conn:
            events: list[Any] = []
            await until(conn, events, "session.created")
            await conn.session.update(session={
                "type": "realtime", "instructions": SYSTEM, "tools": [WEATHER_TOOL], "tool_choice": "auto",
                "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 400}}}})
            updated = await until(conn, events, "session.updated")
            assert [t.name for t in updated.session.tools] == ["get_weather"]
            for piece in chunks(pcm24k(question, silence_s=1.0)):
                await conn.input_audio_buffer.append(audio=base64.b64encode(piece).decode())

            done = await until(conn, events, "response.done")
            heard = next(e for e in events if kind(e) == "conversation.item.input_audio_transcription.completed")
            assert "paris" in heard.transcript.lower(), heard.transcript
            calls = [o for o in done.response.output if o.type == "function_call"]
            assert len(calls) == 1, (done.response.output, [kind(e) for e in events])
            call = calls[0]
            assert call.name == "get_weather" and "paris" in json.loads(call.arguments)["city"].lower(), call
            streamed = "".join(e.delta for e in events if kind(e) == "response.function_call_arguments.delta")
            assert json.loads(streamed) == json.loads(call.arguments)
            args_done = next(e for e in events if kind(e) == "response.function_call_arguments.done")
            assert (args_done.call_id, args_done.item_id) == (call.call_id, call.id)
            spoken = "".join(e.delta for e in events if kind(e) == "response.output_audio_transcript.delta")
            assert "tool_call" not in spoken and "{" not in spoken  # markup is never read out

            await conn.conversation.item.create(item={
                "type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"city": "Paris", "temperature_c": 21, "sky": "sunny"})})
            added = await until(conn, events, "conversation.item.added")
            assert added.item.type == "function_call_output"
            await conn.response.create()
            answer = await until(conn, events, "response.done")
            assert answer.response.status == "completed", answer.response
            (message,) = answer.response.output
            transcript = message.content[0].transcript
            assert "21" in transcript, transcript  # the spoken answer uses the client's result
            audio = b"".join(base64.b64decode(e.delta) for e in events
                             if kind(e) == "response.output_audio.delta" and e.response_id == answer.response.id)
            assert len(audio) > 24_000  # > 0.5 s of 24 kHz PCM16
            # Append-only prompts: the turn after the tool result reused the cached prefix.
            assert answer.response.usage.input_token_details.cached_tokens > 0, answer.response.usage
            assert not [e for e in events if kind(e) == "error"]
    assert not errors, errors


async def test_native_server_tool_calls_the_webhook_says_the_filler_and_answers(
    server: RunningServer, webhook: Webhook
) -> None:
    events: list[dict[str, Any]] = []
    audio: dict[str, int] = {}
    current: str | None = None
    with server_errors() as errors:
        async with websockets.connect(server.ws("/ws"), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000, "turn_detection": False,
                                      "system_prompt": SYSTEM}))
            await ws.send(json.dumps({"type": "text.input", "text": "What's the weather in Paris?"}))
            async with asyncio.timeout(TIMEOUT):
                while sum(e["type"] == "response.done" for e in events) < 2:
                    done = [e for e in events if e["type"] == "response.done"]
                    assert not done or done[0]["tool_calls"], done  # no call: no second reply comes
                    msg = await ws.recv()
                    if isinstance(msg, bytes):
                        audio[current or ""] = audio.get(current or "", 0) + len(msg)
                        continue
                    event = json.loads(msg)
                    events.append(event)
                    if event["type"] == "response.started":
                        current = event["response_id"]
    assert not errors, errors
    assert not [e for e in events if e["type"] == "error"], events
    kinds = [e["type"] for e in events]
    call = next(e for e in events if e["type"] == "tool.call")
    assert call["name"] == "get_weather" and "paris" in json.loads(call["arguments"])["city"].lower(), call
    assert [c["arguments"]["city"].lower() for c in webhook.calls][-1:] == ["paris"]
    result = next(e for e in events if e["type"] == "tool.result")
    assert json.loads(result["output"]) == {"temperature_c": 17, "sky": "cloudy"}
    assert kinds.index("tool.call") < kinds.index("tool.result")
    first, second = [e for e in events if e["type"] == "response.done"]
    assert first["tool_calls"] and first["tool_calls"][0]["call_id"] == call["call_id"]
    # The model said nothing before its call and the webhook was slow: the filler was heard.
    assert first["text"] == "" and first["played_ms"] > 300 and audio.get(first["response_id"], 0) > 0, first
    assert "17" in second["text"], second  # the answer uses the webhook's result
    assert second["tool_calls"] == [] and audio.get(second["response_id"], 0) > 0
