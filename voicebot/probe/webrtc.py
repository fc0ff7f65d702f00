"""Probe client for the WebRTC transport (OpenAI Realtime style, docs/webrtc.md).

The probe's mic is a real aiortc audio track (Opus on the wire) fed by the shared
real-time sender; the reply is read off the remote track after aiortc's jitter buffer
and Opus decoder, so voice-to-voice includes everything the WebRTC path adds. The
Realtime events on ``oai-events`` are translated to the native names the turn logic
reads (see :func:`to_native`).

``--url`` is the server's base URL (``http://127.0.0.1:8080``); the offer goes to
``/v1/realtime/calls``. ``--token`` is sent as the Bearer credential (an ``ek_``
secret or the API key).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Any

import av
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from voicebot.audio import Resampler, float_to_pcm16
from voicebot.probe.base import Audio, ClientClosed, ClientError, ConnectOptions, Event, Incoming
from voicebot.wire.av_frames import frame_to_mono, pcm16_frame

log = logging.getLogger(__name__)

_QUEUE = 2000  # received items; the probe's receiver drains it continuously (~60/s)
_HOLD_DONE_S = 30.0  # longest wait for a reply's output_audio_buffer.stopped
_MIC_QUEUE = 10  # 200 ms: the sender is paced in real time, so more means a stall


def calls_url(url: str) -> str:
    base = url.rstrip("/")
    for scheme, http in (("ws://", "http://"), ("wss://", "https://")):
        if base.startswith(scheme):
            base = http + base[len(scheme) :]
    if base.endswith("/v1/realtime/calls"):
        return base
    return base + "/v1/realtime/calls"


def to_native(data: dict[str, Any]) -> dict[str, Any] | None:
    """A Realtime server event -> the native event the probe's turn logic reads."""
    kind = data.get("type")
    resp: dict[str, Any] = data["response"] if isinstance(data.get("response"), dict) else {}
    rid = data.get("response_id") or resp.get("id")
    if kind == "conversation.item.input_audio_transcription.completed":
        return {
            "type": "transcript.final",
            "item_id": data.get("item_id"),
            "text": data.get("transcript", ""),
        }
    if kind == "input_audio_buffer.speech_started":
        return {"type": "speech.started", "item_id": data.get("item_id")}
    if kind == "input_audio_buffer.speech_stopped":
        return {"type": "speech.stopped", "item_id": data.get("item_id")}
    if kind == "response.created":
        return {"type": "response.started", "response_id": rid}
    if kind == "output_audio_buffer.started":
        return {"type": "response.audio.started", "response_id": rid}
    if kind == "output_audio_buffer.cleared":
        return {"type": "barge_in", "response_id": rid}
    if kind == "response.done":
        return {"type": "response.done", "response_id": rid, **_done_fields(resp)}
    if kind == "error":
        err: dict[str, Any] = data["error"] if isinstance(data.get("error"), dict) else data
        return {
            "type": "error",
            "code": err.get("code"),
            "message": err.get("message"),
            "fatal": False,
        }
    if isinstance(kind, str) and kind.endswith("turn.timings"):  # a voicebot extension, if sent
        return {**{k: v for k, v in data.items() if k != "event_id"}, "type": "turn.timings"}
    return None


def _done_fields(resp: dict[str, Any]) -> dict[str, Any]:
    # Realtime "incomplete" is a reply cut at max_output_tokens: natively, "completed".
    status = resp.get("status")
    status = "completed" if status == "incomplete" else status
    details = resp.get("status_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    if status == "cancelled" and reason == "turn_detected":
        status = "interrupted"
    text = ""
    for item in resp.get("output") or []:
        for part in item.get("content") or [] if isinstance(item, dict) else []:
            if isinstance(part, dict):
                text += part.get("transcript") or part.get("text") or ""
    return {"status": status, "text": text, "full_text": text}


class _MicTrack(MediaStreamTrack):
    """The probe's voice: frames from send_audio(), paced by the probe's own sender."""

    kind = "audio"

    def __init__(self, rate: int) -> None:
        super().__init__()
        self.rate = rate
        self._frames: asyncio.Queue[bytes] = asyncio.Queue(maxsize=_MIC_QUEUE)
        self._pts = 0

    def put(self, pcm: bytes) -> None:
        if self._frames.full():  # stale audio goes first
            self._frames.get_nowait()
        self._frames.put_nowait(pcm)

    async def recv(self) -> Any:
        if self.readyState != "live":
            raise MediaStreamError
        # aiortc sends each frame as soon as recv() returns it: no extra buffering.
        pcm = await self._frames.get()
        samples = np.frombuffer(pcm, dtype="<i2")
        frame = pcm16_frame(samples, self.rate, self._pts)
        self._pts += samples.size
        return frame


class WebRTCClient:
    def __init__(self, options: ConnectOptions) -> None:
        self.options = options
        self.output_rate = options.output_sample_rate or 48_000
        self.session_id: str | None = None
        self.call_path: str | None = None
        self._pc: RTCPeerConnection | None = None
        self._mic = _MicTrack(options.sample_rate)
        self._items: asyncio.Queue[Incoming | None] = asyncio.Queue(maxsize=_QUEUE)
        self._open = asyncio.Event()
        self._closed: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._channel: Any = None
        self.seen: deque[str] = deque(maxlen=1000)  # raw Realtime event types, for debugging
        # Over WebRTC a reply's response.done comes when it is generated, and its audio
        # plays on until output_audio_buffer.stopped: the probe's turn ends at
        # response.done, so the next clip was spoken over the reply's tail (a barge-in
        # candidate, not the new turn it should be). Its done waits for the stop.
        self._playing: set[str] = set()
        self._held: dict[str, Event] = {}

    async def connect(self) -> None:
        opts = self.options
        pc = self._pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTrack(self._mic)
        channel = self._channel = pc.createDataChannel("oai-events")
        channel.on("open", self._open.set)
        channel.on("message", self._on_message)
        channel.on("close", lambda: self._gone("data channel closed"))
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", lambda: self._on_state(pc.connectionState))
        await pc.setLocalDescription(await pc.createOffer())
        answer = await self._post(calls_url(opts.url), pc.localDescription.sdp)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        try:
            await asyncio.wait_for(self._open.wait(), opts.timeout_s)
        except TimeoutError:
            raise ClientError(f"data channel not open within {opts.timeout_s:g} s") from None
        fields = dict(opts.start_fields)
        if "system_prompt" in fields:
            fields["instructions"] = fields.pop("system_prompt")
        if fields:
            self._send({"type": "session.update", "session": {"type": "realtime", **fields}})

    async def _post(self, url: str, sdp: str) -> str:
        headers = {"Content-Type": "application/sdp"}
        if self.options.token:
            headers["Authorization"] = f"Bearer {self.options.token}"
        req = urllib.request.Request(url, data=sdp.encode(), headers=headers, method="POST")

        def post() -> tuple[int, str, str]:
            try:
                with urllib.request.urlopen(req, timeout=self.options.timeout_s) as resp:
                    return resp.status, resp.headers.get("Location", ""), resp.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, "", exc.read().decode(errors="replace")

        try:
            status, location, body = await asyncio.to_thread(post)
        except (OSError, TimeoutError) as exc:
            raise ClientError(f"cannot reach {url}: {exc}") from None
        if status not in (200, 201):
            try:
                err = json.loads(body)["error"]
                detail = f"{err.get('code')}: {err.get('message')}"
            except (ValueError, KeyError, TypeError):
                detail = body[:200]
            raise ClientError(f"offer refused: HTTP {status}: {detail}")
        self.call_path = location or None
        return body

    # ------------------------------------------------------------------ aiortc side
    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            task = asyncio.create_task(self._read_track(track))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _read_track(self, track: MediaStreamTrack) -> None:
        resampler: Resampler | None = None
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                self._gone("remote track ended")
                return
            t = time.monotonic()
            if not isinstance(frame, av.AudioFrame):  # an audio track yields nothing else
                continue
            if resampler is None:
                resampler = Resampler(frame.sample_rate, self.output_rate)
            self._put(Audio(float_to_pcm16(resampler.process(frame_to_mono(frame))), t))

    def _on_message(self, message: str | bytes) -> None:
        t = time.monotonic()
        try:
            data = json.loads(message)
        except (TypeError, ValueError):
            self._put(
                Event({"type": "error", "code": "probe_bad_json", "message": str(message)[:200]}, t)
            )
            return
        if not isinstance(data, dict):
            return
        self.seen.append(str(data.get("type")))
        if data.get("type") == "session.created":
            self.session_id = (data.get("session") or {}).get("id")
        native = to_native(data)
        kind, rid = data.get("type"), data.get("response_id")
        if kind == "output_audio_buffer.started" and rid:
            self._playing.add(rid)
        if native is not None:
            if native["type"] == "response.done" and native.get("response_id") in self._playing:
                self._hold(native["response_id"], Event(native, t))
            else:
                self._put(Event(native, t))
        if kind in ("output_audio_buffer.stopped", "output_audio_buffer.cleared") and rid:
            self._playing.discard(rid)
            self._release(rid)

    def _hold(self, rid: str, done: Event) -> None:
        self._held[rid] = done
        # A stop that never comes must not hang the turn: a reply plays for seconds at most.
        asyncio.get_running_loop().call_later(_HOLD_DONE_S, self._release, rid)

    def _release(self, rid: str) -> None:
        done = self._held.pop(rid, None)
        if done is not None:
            self._put(done)

    def _on_state(self, state: str) -> None:
        if state in ("failed", "closed"):
            self._gone(f"connection {state}")

    def _gone(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
            with contextlib.suppress(asyncio.QueueFull):
                self._items.put_nowait(None)

    def _put(self, item: Incoming) -> None:
        try:
            self._items.put_nowait(item)
        except asyncio.QueueFull:
            log.warning("probe receive queue full; dropping an item")

    def _send(self, event: dict[str, Any]) -> None:
        if self._channel is not None and self._channel.readyState == "open":
            self._channel.send(json.dumps(event))

    # ----------------------------------------------------------------- ProbeClient
    async def send_audio(self, pcm: bytes) -> None:
        if self._closed is not None:
            raise ClientClosed(self._closed)
        self._mic.put(pcm)

    async def receive(self) -> Incoming:
        if self._closed is not None and self._items.empty():
            raise ClientClosed(self._closed)
        item = await self._items.get()
        if item is None:
            raise ClientClosed(self._closed or "closed")
        return item

    async def close(self) -> None:
        pc, self._pc = self._pc, None
        self._gone("closed by the probe")
        self._mic.stop()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        if pc is not None:
            with contextlib.suppress(Exception):  # best effort: the peer may be gone already
                await asyncio.wait_for(pc.close(), 5.0)
