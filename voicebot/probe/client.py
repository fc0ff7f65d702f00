"""The asyncio part: drive sessions in real time and feed TurnTrackers.

Each session is one TaskGroup of three tasks: a sender that streams a 20 ms frame on
a fixed schedule (clip frames, else silence: the server's VAD needs silence to end a
turn), a receiver that timestamps whatever arrives, and the turn loop that decides
what to play next. Nothing outlives the session; every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import soundfile as sf

from voicebot.errors import VoicebotError
from voicebot.probe.base import (
    Audio,
    ClientClosed,
    ClientError,
    ConnectOptions,
    ProbeClient,
    make_client,
)
from voicebot.probe.clips import Clip
from voicebot.probe.turn import TurnRecord, TurnTracker

log = logging.getLogger(__name__)

_POLL_S = 0.01  # turn-loop tick; barge timing is measured from the frames, not this
_RESYNC_S = 0.2  # a sender this far behind (CPU starved) restarts its schedule instead of bursting


@dataclass(frozen=True)
class ProbeConfig:
    url: str
    clips: tuple[Clip, ...]
    turns: int = 3
    protocol: str = "native"
    sample_rate: int = 16000
    output_sample_rate: int | None = None
    frame_ms: int = 20
    stagger_s: float = 0.25
    gap_s: float = 0.5
    timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    threshold_dbfs: float = -40.0
    barge_after_s: float | None = None  # None: no barge-in
    barge_clip: Clip | None = None  # None: the next clip in the cycle
    token: str | None = None
    start_fields: dict[str, Any] = field(default_factory=dict)
    save_audio: Path | None = None
    keep_audio_s: float = 60.0


async def check_reachable(url: str, timeout_s: float) -> None:
    """Fail fast, with one clear message, when nothing listens at ``url``."""
    parts = urlsplit(url)
    # http(s): the WebRTC probe posts its SDP offer to an HTTP endpoint.
    if parts.scheme not in ("ws", "wss", "http", "https") or not parts.hostname:
        raise VoicebotError(f"--url must be ws(s):// or http(s)://, got {url!r}", code="invalid_config")
    port = parts.port or (443 if parts.scheme in ("wss", "https") else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout_s)
    except (OSError, TimeoutError) as exc:
        raise VoicebotError(
            f"cannot reach {url}: {exc or 'timed out'}", code="unreachable"
        ) from None
    writer.close()
    await writer.wait_closed()


class _Session:
    def __init__(self, cfg: ProbeConfig, index: int, level: int) -> None:
        self.cfg = cfg
        self.index = index
        self.level = level
        self.client: ProbeClient = make_client(
            cfg.protocol,
            ConnectOptions(
                url=cfg.url,
                sample_rate=cfg.sample_rate,
                output_sample_rate=cfg.output_sample_rate,
                token=cfg.token,
                timeout_s=cfg.connect_timeout_s,
                start_fields=cfg.start_fields,
            ),
        )
        self.records: list[TurnRecord] = []
        self.tracker: TurnTracker | None = None
        self.closed: str | None = None
        # what the sender plays: clip, next frame index, callbacks on speech start/end
        self._clip: Clip | None = None
        self._pos = 0
        self._on_start: Callable[[float], None] | None = None
        self._on_end: Callable[[float], None] | None = None
        self._clip_done = asyncio.Event()

    def play(
        self, clip: Clip, on_start: Callable[[float], None] | None, on_end: Callable[[float], None]
    ) -> None:
        self._clip, self._pos, self._on_start, self._on_end = clip, 0, on_start, on_end
        self._clip_done.clear()

    def stop_clip(self) -> None:
        self._clip = None
        self._clip_done.set()

    async def _sender(self) -> None:
        frame_s = self.cfg.frame_ms / 1000.0
        silence = bytes(2 * self.cfg.sample_rate * self.cfg.frame_ms // 1000)
        next_t = time.monotonic()
        try:
            while True:
                next_t += frame_s
                delay = next_t - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -_RESYNC_S:
                    next_t = time.monotonic()
                clip, k = self._clip, self._pos
                await self.client.send_audio(clip.frames[k] if clip is not None else silence)
                if clip is None:
                    continue
                t = time.monotonic()  # the frame is "spoken" once all of it is sent
                self._pos += 1
                if k == clip.first_speech_frame and self._on_start is not None:
                    self._on_start(t)
                if k == clip.last_speech_frame and self._on_end is not None:
                    self._on_end(t)
                if self._pos >= len(clip.frames):
                    self.stop_clip()
        except ClientClosed as exc:
            self.closed = self.closed or str(exc)

    async def _receiver(self) -> None:
        try:
            while True:
                item = await self.client.receive()
                tracker = self.tracker
                if tracker is None:
                    continue
                if isinstance(item, Audio):
                    tracker.on_audio(item.pcm, item.t)
                else:
                    tracker.on_event(item.data, item.t)
        except ClientClosed as exc:
            self.closed = self.closed or str(exc)

    def _failed(self, turn: int, reason: str) -> TurnRecord:
        clips = self.cfg.clips
        return TurnRecord(
            self.index, turn, clips[turn % len(clips)].name, status="failed", errors=[reason]
        )

    async def run(self) -> list[TurnRecord]:
        try:
            await asyncio.wait_for(self.client.connect(), self.cfg.connect_timeout_s * 2)
        except (ClientError, TimeoutError) as exc:
            await self.client.close()
            reason = f"connect: {exc or 'timed out'}"
            log.warning("session %d: %s", self.index, reason)
            return [self._failed(t, reason) for t in range(self.cfg.turns)]
        try:
            async with asyncio.TaskGroup() as tg:
                sender = tg.create_task(self._sender())
                receiver = tg.create_task(self._receiver())
                try:
                    await self._turns()
                finally:
                    sender.cancel()
                    receiver.cancel()
        finally:
            await self.client.close()
        return self.records

    async def _turns(self) -> None:
        cfg = self.cfg
        for turn in range(cfg.turns):
            if self.closed is not None:
                self.records.append(self._failed(turn, f"session ended: {self.closed}"))
                continue
            clip = cfg.clips[turn % len(cfg.clips)]
            record = TurnRecord(self.index, turn, clip.name)
            tracker = TurnTracker(
                record,
                self.client.output_rate,
                barge_after_s=cfg.barge_after_s,
                threshold_dbfs=cfg.threshold_dbfs,
                keep_audio_s=cfg.keep_audio_s,
            )
            self.tracker = tracker
            self.play(clip, None, tracker.speech_ended)
            timed_out = not await self._wait(tracker, time.monotonic() + cfg.timeout_s)
            self.stop_clip()  # after a timeout the clip may still be playing
            self.records.append(
                tracker.finish(time.monotonic(), timed_out=timed_out, reason=self._reason(tracker))
            )
            log.info(
                "session %d turn %d: %s v2v=%s",
                self.index,
                turn,
                record.status,
                record.voice_to_voice_ms,
            )
            if cfg.save_audio is not None:
                path = cfg.save_audio / f"n{self.level}_s{self.index}_t{turn}.wav"
                await asyncio.to_thread(
                    sf.write, path, tracker.reply_audio(), self.client.output_rate
                )
            if tracker.fatal:
                self.closed = self.closed or "fatal error event"
            await asyncio.sleep(cfg.gap_s)  # silence keeps streaming meanwhile

    def _reason(self, tracker: TurnTracker) -> str | None:
        return f"connection closed: {self.closed}" if self.closed is not None else None

    async def _wait(self, tracker: TurnTracker, deadline: float) -> bool:
        cfg = self.cfg
        while (now := time.monotonic()) < deadline:
            if self.closed is not None:
                return True  # finish() records why
            if tracker.barge_due(now):
                nxt = cfg.barge_clip or cfg.clips[(tracker.record.turn + 1) % len(cfg.clips)]
                self.play(nxt, tracker.barge_speech_started, tracker.barge_clip_ended)
            if tracker.finished(now):
                return True
            await asyncio.sleep(_POLL_S)
        return False


async def run_level(cfg: ProbeConfig, sessions: int) -> list[TurnRecord]:
    """``sessions`` concurrent callers, started ``stagger_s`` apart."""

    async def one(i: int) -> list[TurnRecord]:
        await asyncio.sleep(i * cfg.stagger_s)
        return await _Session(cfg, i, sessions).run()

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(i)) for i in range(sessions)]
    records = [r for t in tasks for r in t.result()]
    records.sort(key=lambda r: (r.session, r.turn))
    return records
