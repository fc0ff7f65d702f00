"""What a real call leaves behind, on one real server (real engines, real sockets), over
each of the four protocols (native, Realtime, Twilio Media Streams, WebRTC, each driven
by its probe client): its trace reaches an OTLP/HTTP receiver (in-process, decoding the
protobuf with opentelemetry-proto's classes) with the expected names and parents; its
record is written, with the call's audio beside it; its webhook reaches a real HTTP
server that verifies the signature. A dead
receiver (nothing listens), a slow one and an unwritable record directory leave the
call and the server unharmed.

Each test gives the running server its own Telemetry (``ServerState.telemetry`` is read
as each call opens), so one server start serves them all.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from servers import (
    FAST_SPEECH,
    EnginePool,
    NativeCall,
    RunningServer,
    running_server,
    serve_routes,
    server_errors,
)
from speech import Clip

from voicebot.audio import dbfs
from voicebot.config import ModelsConfig, TelemetryConfig, load_config
from voicebot.observe import webhook as wh
from voicebot.observe.telemetry import Telemetry

pytestmark = pytest.mark.engines  # a real server

SECRET = "whsec_e2e"
STAGES = {"endpointing", "asr", "llm", "first_clause", "tts", "playout"}


@pytest.fixture(scope="module")
async def server(engine_pool: EnginePool, models_config: ModelsConfig) -> AsyncIterator[RunningServer]:
    # A few tokens a reply: the random test model's words are seconds of espeak each, and
    # what is checked is that every stage shows, not how long the reply is.
    cfg = load_config("configs/test.yaml", [f"models.cache_dir={models_config.cache_dir}", FAST_SPEECH, "llm.max_tokens=4",
                                            "server.transports=[native,realtime,twilio,webrtc]"])
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


@dataclass
class Receivers:
    """An OTLP/HTTP trace receiver and a webhook receiver on one local HTTP server."""

    base: str = ""
    spans: list[Any] = field(default_factory=list)  # opentelemetry.proto Span messages
    hooks: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    hold: bool = False  # the webhook is answered only when released (at the fixture's end)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    async def traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf")

    async def hook(self, request: web.Request) -> web.Response:
        self.hooks.append((dict(request.headers), await request.read()))
        if self.hold:
            await self.released.wait()
        return web.Response(status=204)


@pytest.fixture
async def receivers() -> AsyncIterator[Receivers]:
    rec = Receivers()
    async with serve_routes([web.post("/v1/traces", rec.traces), web.post("/hook", rec.hook)]) as base:
        rec.base = base
        yield rec
        rec.released.set()


@pytest.fixture
async def telemetry(server: RunningServer) -> AsyncIterator[list[Telemetry]]:
    """``use(...)`` below puts a Telemetry on the server; it is closed after the test."""
    made: list[Telemetry] = []
    before = server.state.telemetry
    yield made
    server.state.telemetry = before
    for t in made:
        await t.aclose()


def use(server: RunningServer, made: list[Telemetry], cfg: TelemetryConfig, environ: dict[str, str]) -> Telemetry:
    t = Telemetry(cfg, server.state.metrics, environ={"VOICEBOT_WEBHOOK_SECRET": SECRET, **environ})
    server.state.telemetry = t
    made.append(t)
    return t


# Twilio's numbers reach the stream as the TwiML's parameters (/twilio/voice puts them there).
NUMBERS = {"From": "+15550100001", "To": "+15550100002"}


async def one_turn_call(server: RunningServer, clip: Clip, protocol: str = "native") -> tuple[str, dict[str, Any], str]:
    """A caller says ``clip``, hears the reply and hangs up; the call's id, its
    response.done and its carrier's call id (Twilio; else ""). Nothing the telemetry
    does may show in the call."""
    with server_errors() as errors:
        call = await NativeCall.over(server, protocol, start_fields=NUMBERS if protocol == "twilio" else None)
        try:
            done = await call.turn(clip.audio, timeout=90)
            assert done["status"] == "completed" and not call.errors()
        finally:
            await call.close()
        async with asyncio.timeout(10):  # the server let go of it: teardown was not held up
            while call.session_id in server.state.sessions:
                await asyncio.sleep(0.02)
    assert not errors, [e.getMessage() for e in errors]
    return call.session_id, done, getattr(call.client, "call_sid", "")


def counter(server: RunningServer, name: str, outcome: str) -> float:
    m = re.search(rf'^{name}_total{{outcome="{outcome}"}} (\S+)$', server.state.metrics.render().decode(), re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("protocol", ["native", "realtime", "twilio", "webrtc"])
async def test_a_call_leaves_its_trace_record_and_signed_webhook(
    server: RunningServer, receivers: Receivers, telemetry: list[Telemetry], speech_clips: list[Clip], tmp_path: Path,
    protocol: str,
) -> None:
    t = use(server, telemetry, TelemetryConfig(record_dir=str(tmp_path), record_audio=True,
                                              webhook_url=f"{receivers.base}/hook"),
            {"OTEL_EXPORTER_OTLP_ENDPOINT": receivers.base, "OTEL_SERVICE_NAME": "voicebot-e2e"})
    call_id, done, call_sid = await one_turn_call(server, speech_clips[0], protocol)
    await t.aclose()  # flushes the spans, writes the record, sends the webhook

    # The trace: call > turn > the stages, over OTLP/HTTP protobuf.
    by_id = {s.span_id: s for s in receivers.spans}
    (call,) = [s for s in receivers.spans if s.name == "call"]
    attrs = {a.key: a.value for a in call.attributes}
    assert attrs["voicebot.call_id"].string_value == call_id and attrs["voicebot.protocol"].string_value == protocol
    assert attrs["voicebot.hung_up_by"].string_value == "caller"
    assert call.parent_span_id == b""
    (turn,) = [s for s in receivers.spans if s.name == "turn"]
    assert turn.parent_span_id == call.span_id and turn.trace_id == call.trace_id
    children = [s for s in receivers.spans if s.parent_span_id == turn.span_id]
    assert {s.name for s in children} == STAGES
    assert all(turn.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano <= turn.end_time_unix_nano
               for s in children)
    llm = next(s for s in children if s.name == "llm")
    llm_attrs = {a.key: a.value for a in llm.attributes}
    assert llm_attrs["gen_ai.usage.output_tokens"].int_value > 0
    assert llm_attrs["gen_ai.usage.input_tokens"].int_value > 0
    assert llm_attrs["voicebot.llm.ttft_ms"].double_value > 0
    assert set(by_id) == {s.span_id for s in receivers.spans}, "no span twice"
    text_keys = [a.key for s in receivers.spans for a in s.attributes if "transcript" in a.key or "heard" in a.key]
    assert not text_keys, "no caller text in spans unless telemetry.include_text"

    # The record, on disk.
    (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".json")]
    assert call_id in name
    with open(tmp_path / name, encoding="utf-8") as f:  # noqa: ASYNC230 (a test's small file)
        record = json.load(f)
    assert record["call_id"] == call_id and record["protocol"] == protocol and record["hung_up_by"] == "caller"
    (rturn,) = record["turns"]
    assert rturn["transcript"].strip()
    (reply,) = rturn["replies"]
    assert reply["response_id"] == done["response_id"] and reply["status"] == "completed"
    assert reply["text"].strip() and reply["heard"] == reply["text"]
    assert reply["timings"]["voice_to_voice_ms"] > 0
    assert reply["tokens"]["output"] == llm_attrs["gen_ai.usage.output_tokens"].int_value
    if protocol == "twilio":  # the carrier's ids and the numbers, from the stream's start
        assert record["details"]["carrier"] == "twilio" and record["details"]["stream_id"].startswith("MZ")
        assert record["details"]["carrier_call_id"] == call_sid
        assert record["details"]["from"] == NUMBERS["From"] and record["details"]["to"] == NUMBERS["To"]
        assert attrs["voicebot.carrier_call_id"].string_value == call_sid
        assert "voicebot.from" not in attrs, "no phone number in spans unless telemetry.include_text"

    # The call's audio, beside its record: as long as the call, the caller's speech on
    # the left and the reply on the right.
    assert record["audio"]["file"] == name.replace(".json", ".wav") and record["audio"]["complete"]
    audio, rate = sf.read(tmp_path / record["audio"]["file"], dtype="float32")
    assert rate == 16000 and audio.shape[1] == 2
    assert abs(audio.shape[0] / rate - record["duration_s"]) < 0.25, (audio.shape[0] / rate, record["duration_s"])
    for side in (0, 1):
        loudest = max(dbfs(audio[i : i + rate // 2, side]) for i in range(0, audio.shape[0], rate // 4))
        assert loudest > -35, f"channel {side} is silent ({loudest:.1f} dBFS)"
    assert np.abs(audio[:, 1]).max() > 0

    # The webhook: the same record, signed.
    (headers, body) = receivers.hooks[0]
    assert wh.verify(SECRET.encode(), headers[wh.TIMESTAMP_HEADER], headers[wh.SIGNATURE_HEADER], body)
    assert headers[wh.DELIVERY_HEADER] == call_id and json.loads(body) == record


async def test_a_dead_receiver_and_an_unwritable_directory_harm_no_call(
    server: RunningServer, telemetry: list[Telemetry], speech_clips: list[Clip], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    failed_records = counter(server, "voicebot_call_records", "failed")
    failed_hooks = counter(server, "voicebot_call_webhooks", "failed")
    # Nothing listens at the webhook's port (the discard port).
    t = use(server, telemetry, TelemetryConfig(record_dir=str(blocker / "calls"), webhook_url="http://127.0.0.1:9/hook",
                                              webhook_attempts=2, webhook_backoff_s=0.1), {})
    await one_turn_call(server, speech_clips[1])
    await t.aclose()
    assert counter(server, "voicebot_call_records", "failed") == failed_records + 1
    assert counter(server, "voicebot_call_webhooks", "failed") == failed_hooks + 1
    assert server.state.status()[0] == "ok"  # and the next test's call is served as usual


async def test_a_slow_receiver_holds_up_no_call_and_shutdown_waits_only_its_bound(
    server: RunningServer, receivers: Receivers, telemetry: list[Telemetry], speech_clips: list[Clip]
) -> None:
    receivers.hold = True
    dropped = counter(server, "voicebot_call_webhooks", "dropped")
    t = use(server, telemetry, TelemetryConfig(webhook_url=f"{receivers.base}/hook", webhook_timeout_s=30.0,
                                              shutdown_wait_s=0.5), {})
    await one_turn_call(server, speech_clips[3])  # its teardown does not wait for the receiver
    async with asyncio.timeout(10):
        while not receivers.hooks:
            await asyncio.sleep(0.02)
    t0 = time.monotonic()
    await t.aclose()
    assert time.monotonic() - t0 < 5, "shutdown waited past telemetry.shutdown_wait_s"
    assert counter(server, "voicebot_call_webhooks", "dropped") == dropped + 1
