"""A server whose event loop runs late refuses new calls on every wire, each in its own
way for "try later" (server.admission_max_loop_lag_ms; the measure is in
tests/runtime/test_loop_lag.py, the admission's rules in tests/transports/test_edge.py).

The real app and transports through Starlette's test client, with no engines loaded:
admission is decided before a call would use one. The loop watch's samples are given as
its tick records them."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from voicebot.config import Config, ServerConfig
from voicebot.runtime.loop_watch import LoopWatch
from voicebot.server.app import create_app
from voicebot.server.state import ServerState


class _Stage:
    queue_depth = running = background_waiting = 0

    def voices(self) -> list[str]:
        return []


class _Engines:
    """Up (no failure), with what /healthz reads; a call never gets to use them."""

    health: dict[str, object] = {}
    asr = tts = llm = _Stage()

    def failure(self) -> str | None:
        return None


def overloaded_client() -> tuple[TestClient, ServerState]:
    state = ServerState(Config(server=ServerConfig(admission_max_loop_lag_ms=300)))
    state.engines = _Engines()  # type: ignore[assignment]
    state.loop = LoopWatch(0.0)
    now = time.monotonic()
    for i in range(10, -1, -1):  # ~2 s late at every tick over the last second
        state.loop.history.observe(now - i * 0.1, 2.0)
    # No `with`: the lifespan (which would load engines and start the watch) does not run.
    return TestClient(create_app(state.cfg, load=False, state=state)), state


def test_each_transport_refuses_a_new_call_while_the_loop_is_late() -> None:
    client, state = overloaded_client()

    with client.websocket_connect("/ws") as ws:  # native: an error event, then close 1013
        ws.send_json({"type": "session.start", "sample_rate": 16000})
        event = ws.receive_json()
        assert event["type"] == "error" and event["code"] == "capacity_exceeded" and event["fatal"], event
        assert "event loop ran" in event["message"]
        assert ws.receive()["code"] == 1013

    with client.websocket_connect("/v1/realtime") as ws:  # OpenAI Realtime: its error event
        event = ws.receive_json()
        assert event["type"] == "error" and event["error"]["code"] == "capacity_exceeded", event
        assert ws.receive()["code"] == 1013

    r = client.post("/v1/realtime/calls", content="v=0\r\n", headers={"Content-Type": "application/sdp"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "capacity_exceeded", r.text  # WebRTC

    r = client.post("/twilio/voice")  # a phone call: the busy message, and the carrier hangs up
    assert r.status_code == 200 and "<Hangup/>" in r.text, r.text

    assert state.metrics.admission_refusals.labels("loop_lag")._value.get() == 4
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["status"] == "overloaded"
