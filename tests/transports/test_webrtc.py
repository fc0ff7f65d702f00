"""WebRTC transport: real app, real engines, aiortc on loopback as the page.

The client is the probe's WebRTCClient (a real aiortc peer: Opus mic track out, remote
track in, Realtime events on "oai-events"), so these tests cover the probe as well.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator

import httpx
import jiwer
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection
from servers import FAST_SPEECH, EnginePool, RunningServer, running_server
from speech import Clip

from voicebot.audio import dbfs, float_to_pcm16, pcm16_to_float
from voicebot.config import ModelsConfig, load_config
from voicebot.probe.base import Audio, ClientClosed, ConnectOptions, Event
from voicebot.probe.webrtc import WebRTCClient
from voicebot.transports import webrtc_call
from voicebot.transports.webrtc_tracks import FRAME, RATE, ReplyTrack

pytestmark = [pytest.mark.engines, pytest.mark.timeout(400)]  # a hang guard; the module's server load counts to its first test

_FRAME_16K = 320  # 20 ms at 16 kHz


@pytest.fixture(scope="module")
async def server(engine_pool: EnginePool, models_config: ModelsConfig) -> AsyncIterator[RunningServer]:
    cfg = load_config(
        "configs/test.yaml", [f"models.cache_dir={models_config.cache_dir}", FAST_SPEECH, "llm.max_tokens=12"]
    )
    async with running_server(cfg, pool=engine_pool) as running:
        yield running


def _normalize(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower().replace("-", " ")).split())


class _Mouth:
    """The page's microphone: a clip when asked, silence otherwise, in real time."""

    def __init__(self, client: WebRTCClient) -> None:
        self.client = client
        self.frames: list[bytes] = []

    def say(self, audio: np.ndarray) -> None:
        padded = np.pad(audio, (0, -len(audio) % _FRAME_16K))
        self.frames = [float_to_pcm16(f) for f in padded.reshape(-1, _FRAME_16K)]

    async def run(self) -> None:
        silence = bytes(2 * _FRAME_16K)
        t0, k = time.monotonic(), 0
        while True:
            await self.client.send_audio(self.frames.pop(0) if self.frames else silence)
            k += 1
            await asyncio.sleep(max(0.0, t0 + k * 0.02 - time.monotonic()))


async def _settled(server: RunningServer, deadline_s: float = 10.0) -> None:
    """Wait until nothing of any call is left server-side."""
    state = server.state
    assert state.engines is not None
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if (
            not state.sessions
            and not state.peer_connections
            and state.engines.llm.unfinished_requests() == 0
        ):
            break
        await asyncio.sleep(0.05)
    assert not state.sessions, list(state.sessions)
    assert not state.peer_connections
    assert state.engines.llm.unfinished_requests() == 0
    names = [
        t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith(("webrtc-", "sess_"))
    ]
    assert not names, names


async def test_voice_turn_and_barge_in_over_webrtc(
    server: RunningServer, speech_clips: list[Clip]
) -> None:
    # 3.3 s ("he might even have been made amiable himself"), then 5.3 s over the reply
    turn, barge = speech_clips[4], speech_clips[2]
    # A longer reply than the suite's 12 tokens, so there is a reply to talk over.
    client = WebRTCClient(ConnectOptions(url=server.http, start_fields={"max_output_tokens": 64}))
    await client.connect()
    assert client.call_path and client.call_path.startswith("/v1/realtime/calls/rtc_")
    assert len(server.state.peer_connections) == 1
    mouth = _Mouth(client)
    speaker = asyncio.create_task(mouth.run())
    transcript: str | None = None
    types: list[str] = []
    statuses: list[str] = []
    loud_ms = 0.0
    barged = False
    cleared_at: float | None = None
    loud_after_clear: list[tuple[float, float]] = []  # (s after the clear, ms of audio)
    try:
        mouth.say(turn.audio)
        async with asyncio.timeout(60):
            while cleared_at is None or time.monotonic() < cleared_at + 1.5:
                item = await client.receive()
                if isinstance(item, Event):
                    types.append(item.data["type"])
                    if item.data["type"] == "transcript.final" and item.data["text"]:
                        transcript = transcript or item.data["text"]
                    if item.data["type"] == "barge_in":
                        cleared_at = item.t
                    if item.data["type"] == "response.done":
                        statuses.append(item.data["status"])
                    continue
                assert isinstance(item, Audio)
                if transcript is None or dbfs(pcm16_to_float(item.pcm)) <= -40:
                    continue
                if cleared_at is not None:
                    loud_after_clear.append((item.t - cleared_at, 1000 * len(item.pcm) / 2 / client.output_rate))
                    continue
                loud_ms += 1000 * len(item.pcm) / 2 / client.output_rate
                if loud_ms >= 300 and not barged:
                    barged = True
                    mouth.say(barge.audio)  # talk over the reply
    finally:
        speaker.cancel()
        await client.close()
    wer = jiwer.wer(_normalize(turn.text), _normalize(transcript or ""))
    assert wer <= 0.25, (transcript, turn.text)
    assert "output_audio_buffer.started" in client.seen
    assert not any("audio.delta" in t for t in client.seen)  # audio goes on the media track
    assert "output_audio_buffer.cleared" in client.seen
    assert "interrupted" in statuses, (statuses, types)
    # Flushed: what was queued is not played out after the barge-in (jitter buffer aside).
    # Counted in audio, not arrival times: on a starved loop frames sent before the clear
    # can arrive later than it.
    assert sum(ms for _t, ms in loud_after_clear) <= 300, loud_after_clear
    await _settled(server)


async def test_client_output_audio_buffer_clear_cancels_the_reply(
    server: RunningServer, speech_clips: list[Clip]
) -> None:
    """output_audio_buffer.clear from the page (e.g. a push-to-talk button): the reply is
    cancelled, not just cut on the track. It used to flush the track only: the reply went
    on generating, response.done said "completed" and the history kept all of it."""
    turn = speech_clips[4]
    client = WebRTCClient(ConnectOptions(url=server.http, start_fields={"max_output_tokens": 64}))
    await client.connect()
    mouth = _Mouth(client)
    speaker = asyncio.create_task(mouth.run())
    playing: str | None = None
    cleared: dict[str, object] | None = None
    cleared_at: float | None = None
    done: dict[str, str] = {}
    loud_ms = 0.0
    loud_after_clear: list[tuple[float, float]] = []  # (s after the clear, ms of audio)
    try:
        mouth.say(turn.audio)
        deadline = time.monotonic() + 60
        # After the clear: 1.5 s of listening, and the reply's response.done (which a
        # cancel sends at once) within 10 s.
        while cleared_at is None or time.monotonic() < cleared_at + 1.5 or playing not in done:
            if time.monotonic() > (deadline if cleared_at is None else cleared_at + 10):
                break
            try:
                item = await asyncio.wait_for(client.receive(), 1.0)
            except TimeoutError:
                continue
            if isinstance(item, Event):
                if item.data["type"] == "response.audio.started":
                    playing = playing or item.data["response_id"]
                elif item.data["type"] == "barge_in":  # output_audio_buffer.cleared
                    cleared, cleared_at = item.data, item.t
                elif item.data["type"] == "response.done":
                    done[item.data["response_id"]] = item.data["status"]
                continue
            assert isinstance(item, Audio)
            if playing is None or dbfs(pcm16_to_float(item.pcm)) <= -40:
                continue
            if cleared_at is not None:
                loud_after_clear.append((item.t - cleared_at, 1000 * len(item.pcm) / 2 / client.output_rate))
                continue
            loud_ms += 1000 * len(item.pcm) / 2 / client.output_rate
            if loud_ms >= 300 and playing not in done:
                client._send({"type": "output_audio_buffer.clear"})
                loud_ms = -1e9  # once
    finally:
        speaker.cancel()
        await client.close()
    seen = list(client.seen)[-40:]
    assert playing is not None and cleared is not None, (playing, cleared, done, seen)
    assert cleared["response_id"] == playing, (cleared, playing)
    assert done.get(playing) == "cancelled", (done, seen)  # the reply itself stopped
    # Nothing of that reply is played after the clear (jitter buffer aside), counted in
    # audio as above.
    assert sum(ms for _t, ms in loud_after_clear) <= 300, loud_after_clear
    await _settled(server)


async def test_ephemeral_secret_with_auth_on(server: RunningServer) -> None:
    state = server.state
    state.cfg.server.api_key = "sk-test-key"
    try:
        async with httpx.AsyncClient(base_url=server.http, timeout=10) as http:
            r = await http.post("/v1/realtime/client_secrets", json={})
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "unauthorized"
            r = await http.post(
                "/v1/realtime/client_secrets",
                headers={"Authorization": "Bearer sk-test-key"},
                json={
                    "expires_after": {"anchor": "created_at", "seconds": 60},
                    "session": {"type": "realtime", "instructions": "Answer like a pirate."},
                },
            )
            assert r.status_code == 200, r.text
            secret = r.json()
            assert secret["value"].startswith("ek_") and secret["expires_at"] > time.time() + 30
            # The ephemeral secret cannot mint more secrets.
            r = await http.post(
                "/v1/realtime/client_secrets",
                headers={"Authorization": f"Bearer {secret['value']}"},
            )
            assert r.status_code == 401
            r = await http.post(
                "/v1/realtime/calls", content="v=0\r\n", headers={"Content-Type": "application/sdp"}
            )
            assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"

        refused = WebRTCClient(ConnectOptions(url=server.http, token="ek_wrong"))
        with pytest.raises(Exception, match="HTTP 401"):
            await refused.connect()
        await refused.close()

        client = WebRTCClient(ConnectOptions(url=server.http, token=secret["value"]))
        await client.connect()
        (session,) = state.sessions.values()
        assert (
            session.settings.system_prompt == "Answer like a pirate."
        )  # the secret's session config
        await client.close()
    finally:
        state.cfg.server.api_key = None
    await _settled(server)


async def test_bad_requests_and_capacity_are_json_errors(server: RunningServer) -> None:
    state = server.state
    async with httpx.AsyncClient(base_url=server.http, timeout=10) as http:
        r = await http.post(
            "/v1/realtime/calls", content="hello", headers={"Content-Type": "application/sdp"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_sdp"
        r = await http.post(
            "/v1/realtime", content="hello", headers={"Content-Type": "application/sdp"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_sdp"  # beta path
        # A multipart type over a body that is not multipart: the parser's error is ours too.
        r = await http.post(
            "/v1/realtime/calls",
            content="garbage",
            headers={"Content-Type": "multipart/form-data; boundary=x"},
        )
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == "invalid_sdp"
        r = await http.post("/v1/realtime/calls", json={"sdp": "v=0"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = await http.post("/v1/realtime/client_secrets", json={"expires_after": {"seconds": 1}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"

        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio")
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        saved = state.cfg.server.max_sessions
        state.cfg.server.max_sessions = 1
        state.siblings.opened(None)  # a call in progress: the one slot is taken
        try:
            r = await http.post(
                "/v1/realtime/calls",
                content=pc.localDescription.sdp,
                headers={"Content-Type": "application/sdp"},
            )
        finally:
            state.siblings.closed(None)
            state.cfg.server.max_sessions = saved
            await pc.close()
        assert r.status_code == 429
        assert r.json()["error"] == {
            "type": "rate_limit_error",
            "code": "capacity_exceeded",
            "message": r.json()["error"]["message"],
        }
    await _settled(server)


async def _offer() -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def test_a_foreign_page_cannot_open_calls(server: RunningServer) -> None:
    """text/plain needs no CORS preflight: without the origin check any web page could
    open calls on a keyless server (the browser cannot read the answer, but the call,
    its session and its slot exist)."""
    pc, sdp = await _offer()
    try:
        async with httpx.AsyncClient(base_url=server.http, timeout=10) as http:
            for path in ("/v1/realtime/calls", "/v1/realtime"):
                r = await http.post(path, content=sdp, headers={
                    "Content-Type": "text/plain;charset=UTF-8", "Origin": "https://evil.example"})
                assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
            r = await http.post("/v1/realtime/client_secrets", json={},
                                headers={"Origin": "https://evil.example"})
            assert r.status_code == 403
            assert not server.state.sessions and not server.state.peer_connections
            # Our own page (same origin) gets through to the next check.
            r = await http.post("/v1/realtime/calls", content="hello", headers={
                "Content-Type": "text/plain", "Origin": server.http})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_sdp"
    finally:
        await pc.close()
    await _settled(server)


async def test_request_bodies_are_bounded_as_they_stream(server: RunningServer) -> None:
    big = "v=0\r\n" + "a=x-pad:" + "x" * (4 << 20)
    secrets_before = len(server.state.secrets)

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: only streaming can tell
        data = big.encode()
        for i in range(0, len(data), 64 << 10):
            yield data[i : i + (64 << 10)]

    async with httpx.AsyncClient(base_url=server.http, timeout=30) as http:
        r = await http.post("/v1/realtime/calls", content=big, headers={"Content-Type": "application/sdp"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
        r = await http.post("/v1/realtime/calls", content=chunked(), headers={"Content-Type": "application/sdp"})
        assert r.status_code == 413, r.text
        r = await http.post("/v1/realtime/client_secrets",
                            json={"session": {"instructions": "a" * (1 << 20)}})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
        r = await http.post("/v1/realtime/client_secrets", content="[" * 100_000 + "]" * 100_000,
                            headers={"Content-Type": "application/json"})
        assert r.status_code in (400, 413), r.text
    assert len(server.state.secrets) <= secrets_before  # no refused request minted a secret


async def test_data_channel_messages_have_the_size_limit(server: RunningServer) -> None:
    cfg = server.state.cfg.server
    old, cfg.max_message_bytes = cfg.max_message_bytes, 4096
    client = WebRTCClient(ConnectOptions(url=server.http))
    try:
        await client.connect()
        padded = json.dumps({"type": "input_audio_buffer.clear", "pad": "x" * 8000})
        client._channel.send(padded)
        async with asyncio.timeout(10):
            while True:
                item = await client.receive()
                if isinstance(item, Event) and item.data["type"] == "error":
                    break
        assert item.data["code"] == "message_too_large", item.data
        assert "input_audio_buffer.cleared" not in client.seen  # refused, not carried out
        client._channel.send(json.dumps({"type": "input_audio_buffer.clear"}))
        async with asyncio.timeout(10):
            while "input_audio_buffer.cleared" not in client.seen:  # the call goes on
                await asyncio.sleep(0.05)
    finally:
        cfg.max_message_bytes = old
        await client.close()
    await _settled(server)


def test_data_channel_messages_are_peeked_within_the_json_limits() -> None:
    # Every data-channel message is peeked at for WebRTC's own events before the Realtime
    # translator sees it: an unbounded json.loads there parsed 300k arrays (~0.24 s of the
    # shared loop) that the edge's limits refuse unparsed.
    assert webrtc_call._peek_type('{"type": "output_audio_buffer.clear"}') == "output_audio_buffer.clear"
    wide = json.dumps({"type": "output_audio_buffer.clear", "items": [[] for _ in range(300_000)]})
    assert webrtc_call._peek_type(wide) is None  # the translator answers it with the error
    assert webrtc_call._peek_type("[" * 100_000) is None
    assert webrtc_call._peek_type("{not json") is None


@pytest.mark.parametrize("how", ["data_channel", "abandoned", "shutdown"])
async def test_call_ends_and_cleans_up(
    server: RunningServer, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However the call ends, its session, peer connection and tasks go with it."""
    state = server.state
    monkeypatch.setattr(webrtc_call, "_CONNECT_TIMEOUT_S", 1.0)
    if how == "abandoned":
        # An offer answered but never connected (the page navigated away).
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio")
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        async with httpx.AsyncClient(base_url=server.http, timeout=10) as http:
            # The unified interface: multipart sdp + session, as a backend would send it.
            form = {"sdp": pc.localDescription.sdp, "session": '{"instructions": "Be brief."}'}
            r = await http.post("/v1/realtime/calls", files={k: (None, v) for k, v in form.items()})
        await pc.close()
        assert r.status_code == 201, r.text
        assert r.headers["location"].startswith("/v1/realtime/calls/rtc_")
        assert r.text.startswith("v=0") and r.headers["content-type"].startswith("application/sdp")
        (session,) = state.sessions.values()
        assert session.settings.system_prompt == "Be brief."
        await _settled(server)
        return
    client = WebRTCClient(ConnectOptions(url=server.http))
    await client.connect()
    assert len(state.sessions) == 1 and len(state.peer_connections) == 1
    if how == "data_channel":
        client._channel.close()  # the page closes "oai-events" but keeps the connection
        await _settled(server)
    else:
        await state.close_all()  # what the app's lifespan does on shutdown
        assert not state.sessions and not state.peer_connections
        with pytest.raises(ClientClosed):
            async with asyncio.timeout(10):
                while True:
                    await client.receive()
    await client.close()
    await _settled(server)


async def test_reply_track_paces_flushes_and_reports() -> None:
    """The outbound track: one resample to 48 kHz, real-time frames, silence, flush."""
    seen: list[tuple[str, str]] = []

    class Listener:
        def audio_started(self, rid: str) -> None:
            seen.append(("started", rid))

        def audio_sent(self, rid: str, ms: int) -> None:
            pass

        def audio_stopped(self, rid: str) -> None:
            seen.append(("stopped", rid))

    track = ReplyTrack(listener=Listener())
    tone = (0.5 * np.sin(np.arange(2400) * 2 * np.pi * 440 / 24000)).astype(np.float32)  # 100 ms
    track.push("r1", tone, 24000)
    track.finish("r1")
    assert track.queued_ms >= 100
    t0 = time.monotonic()
    frames = [await track.recv() for _ in range(10)]
    elapsed = time.monotonic() - t0
    # 9 frame periods after the first: paced, not a burst (0.18 s); the upper bound only
    # catches a hang, the frames' pts below say they are 20 ms apart.
    assert 0.15 <= elapsed <= 2.0
    assert all(f.sample_rate == RATE and f.samples == FRAME for f in frames)
    assert [f.pts for f in frames] == [i * FRAME for i in range(10)]
    levels = [dbfs(f.to_ndarray().reshape(-1) / 32768.0) for f in frames]
    assert all(level > -10 for level in levels[:5]) and levels[-1] == float("-inf")
    assert seen == [("started", "r1"), ("stopped", "r1")]

    track.push("r2", np.tile(tone, 10), 24000)  # 1 s
    assert track.flush() >= 900
    assert track.queued_ms == 0
    track.push("r2", tone, 24000)  # late audio of a flushed reply is dropped
    assert track.queued_ms == 0
    track.stop()


async def test_the_probe_ends_a_webrtc_reply_when_its_audio_stops_not_at_response_done() -> None:
    # Over WebRTC response.done comes when the reply is generated; its audio plays on until
    # output_audio_buffer.stopped. The probe ended the turn at response.done and spoke the
    # next clip over the reply's tail: test_short_utterance's one-word second turn was then
    # a barge-in candidate, lost when its speech fell under barge_in_min_ms (a CI failure).
    client = WebRTCClient(ConnectOptions("http://127.0.0.1:1"))
    say = lambda **e: client._on_message(json.dumps(e))  # noqa: E731
    say(type="output_audio_buffer.started", response_id="r1")
    say(type="response.done", response={"id": "r1", "status": "completed"})
    assert client._items.qsize() == 1  # the audio start only: the done waits for playout
    say(type="output_audio_buffer.stopped", response_id="r1")
    kinds = [(await client.receive()).data["type"] for _ in range(2)]  # type: ignore[union-attr]
    assert kinds == ["response.audio.started", "response.done"]
    # A reply with no audio (text only) is done at once; one cut by the page is done when cleared.
    say(type="response.done", response={"id": "r2", "status": "completed"})
    say(type="output_audio_buffer.started", response_id="r3")
    say(type="response.done", response={"id": "r3", "status": "cancelled"})
    say(type="output_audio_buffer.cleared", response_id="r3")
    kinds = [(await client.receive()).data["type"] for _ in range(4)]  # type: ignore[union-attr]
    assert kinds == ["response.done", "response.audio.started", "barge_in", "response.done"]
