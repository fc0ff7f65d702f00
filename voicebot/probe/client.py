"""The asyncio part: drive sessions in real time and feed TurnTrackers.

Each session streams a 20 ms frame on a fixed schedule (clip frames, else silence: the
server's VAD needs silence to end a turn), timestamps whatever arrives, and runs a turn
loop that decides what to play next. Nothing outlives the session; every wait has a
deadline.

Built to load a server with hundreds of callers from one machine (docs/gpu-results.md):

- one :class:`FrameClock` per process sends every session's frame (clients with a
  non-blocking ``send_audio_nowait``, the native one) instead of a timer per session,
  in ``PHASES`` groups a few ms apart so the server does not get every frame at once;
- the turn loop sleeps until an event, the onset or a deadline wakes it (no polling);
- the receiver measures levels only while they can change the record (turn.py);
- ``ProbeConfig.workers`` > 1 spreads the sessions over that many processes, each with
  its own event loop (uvloop where installed), started before the first session, and
  reports what they cost (:class:`ProbeStats`: CPU, how late the frame clock ran).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import numpy as np
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
from voicebot.probe.measure import percentiles
from voicebot.probe.turn import TurnRecord, TurnTracker

log = logging.getLogger(__name__)

_WAKE_S = 0.25  # longest turn-loop sleep without a wake-up (a safety net, not a poll)
_RESYNC_S = 0.2  # a sender this far behind (CPU starved) restarts its schedule instead of bursting
PHASES = 4  # frame-clock groups per frame period: sessions send in 4 staggered bursts
_START_MARGIN_S = 0.5  # worker processes get the start time this far ahead


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
    # "even": session i starts at i * stagger_s and every caller waits gap_s after a reply.
    # "poisson": starts and waits as independent callers make them, a Poisson process of
    # the same mean rate (exponential gaps of mean stagger_s / gap_s, drawn from ``seed``):
    # clumps and lulls, as real traffic has, repeatable run to run.
    arrivals: Literal["even", "poisson"] = "even"
    seed: int = 0
    timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    threshold_dbfs: float = -40.0
    barge_after_s: float | None = None  # None: no barge-in
    barge_clip: Clip | None = None  # None: the next clip in the cycle
    backchannel: bool = False  # barge_clip is a backchannel: the reply should go on
    token: str | None = None
    start_fields: dict[str, Any] = field(default_factory=dict)
    save_audio: Path | None = None
    keep_audio_s: float = 60.0  # per turn, only with save_audio
    workers: int = 1  # processes the sessions are spread over (1: this event loop)
    # Several servers (frontends): session i calls urls[i % len(urls)]; empty: every session calls url.
    urls: tuple[str, ...] = ()


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


class FrameClock:
    """Sends the next frame of every registered session, ``PHASES`` groups per frame.

    One timer per process instead of one per session: at hundreds of sessions the
    per-session sleeps and send coroutines were most of the probe's CPU. Lateness of
    each tick is recorded: it is the probe's own loop lag, the error it adds to every
    timestamp it takes.
    """

    def __init__(self, frame_s: float) -> None:
        self.frame_s = frame_s
        self._groups: list[list[_Session]] = [[] for _ in range(PHASES)]
        self.late_ms: list[float] = []  # one per tick, bounded by the run's length
        self.ticks = 0
        self.skipped = 0  # frames held back because a socket's write buffer was full

    def add(self, session: _Session) -> None:
        self._groups[session.index % PHASES].append(session)

    def remove(self, session: _Session) -> None:
        group = self._groups[session.index % PHASES]
        if session in group:
            group.remove(session)

    async def run(self) -> None:
        step = self.frame_s / PHASES
        next_t = time.monotonic()
        phase = 0
        while True:
            next_t += step
            delay = next_t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -_RESYNC_S:
                next_t = time.monotonic()
            now = time.monotonic()
            self.ticks += 1
            if len(self.late_ms) < 1_000_000:
                self.late_ms.append(1000.0 * max(0.0, now - next_t))
            for session in self._groups[phase]:
                if not session.tick():
                    self.skipped += 1
            phase = (phase + 1) % PHASES


class _Session:
    def __init__(self, cfg: ProbeConfig, index: int, level: int) -> None:
        self.cfg = cfg
        self.index = index
        self.level = level
        self.client: ProbeClient = make_client(
            cfg.protocol,
            ConnectOptions(
                url=cfg.urls[index % len(cfg.urls)] if cfg.urls else cfg.url,
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
        self._silence = bytes(2 * cfg.sample_rate * cfg.frame_ms // 1000)
        self._wake = asyncio.Event()  # something the turn loop waits for may have happened

    def play(
        self, clip: Clip, on_start: Callable[[float], None] | None, on_end: Callable[[float], None]
    ) -> None:
        self._clip, self._pos, self._on_start, self._on_end = clip, 0, on_start, on_end

    def stop_clip(self) -> None:
        self._clip = None

    def _sent(self, clip: Clip | None, k: int) -> None:
        """Bookkeeping after frame ``k`` of ``clip`` (None: silence) went out."""
        if clip is None:
            return
        t = time.monotonic()  # the frame is "spoken" once all of it is sent
        self._pos += 1
        if k == clip.first_speech_frame and self._on_start is not None:
            self._on_start(t)
        if k == clip.last_speech_frame and self._on_end is not None:
            self._on_end(t)
            self._wake.set()
        if self._pos >= len(clip.frames):
            self.stop_clip()

    def tick(self) -> bool:
        """Send the next frame now, without waiting (FrameClock); False if held back."""
        clip, k = self._clip, self._pos
        try:
            sent = self.client.send_audio_nowait(  # type: ignore[attr-defined]
                clip.frames[k] if clip is not None else self._silence
            )
        except ClientClosed as exc:
            self.closed = self.closed or str(exc)
            self._wake.set()
            return True
        if sent:
            self._sent(clip, k)
        return sent

    async def _sender(self) -> None:
        """A timer of its own: clients that can only send with an await."""
        frame_s = self.cfg.frame_ms / 1000.0
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
                await self.client.send_audio(clip.frames[k] if clip is not None else self._silence)
                self._sent(clip, k)
        except ClientClosed as exc:
            self.closed = self.closed or str(exc)
            self._wake.set()

    async def _receiver(self) -> None:
        try:
            while True:
                item = await self.client.receive()
                tracker = self.tracker
                if tracker is None:
                    continue
                if isinstance(item, Audio):
                    if tracker.onset_t is None:
                        tracker.on_audio(item.pcm, item.t)
                        if tracker.onset_t is not None:
                            self._wake.set()
                    else:
                        tracker.on_audio(item.pcm, item.t)
                else:
                    tracker.on_event(item.data, item.t)
                    self._wake.set()
        except ClientClosed as exc:
            self.closed = self.closed or str(exc)
            self._wake.set()

    def _failed(self, turn: int, reason: str) -> TurnRecord:
        clips = self.cfg.clips
        return TurnRecord(
            self.index, turn, clips[turn % len(clips)].name, status="failed", errors=[reason]
        )

    async def run(self, clock: FrameClock | None = None) -> list[TurnRecord]:
        """The whole call. With a ``clock`` (and a client that can send without
        waiting) the clock sends the frames; otherwise a timer of its own does."""
        try:
            await asyncio.wait_for(self.client.connect(), self.cfg.connect_timeout_s * 2)
        except (ClientError, TimeoutError) as exc:
            await self.client.close()
            reason = f"connect: {exc or 'timed out'}"
            log.warning("session %d: %s", self.index, reason)
            return [self._failed(t, reason) for t in range(self.cfg.turns)]
        use_clock = clock is not None and hasattr(self.client, "send_audio_nowait")
        try:
            async with asyncio.TaskGroup() as tg:
                sender = None if use_clock else tg.create_task(self._sender())
                receiver = tg.create_task(self._receiver())
                if use_clock:
                    assert clock is not None
                    clock.add(self)
                try:
                    await self._turns()
                finally:
                    if use_clock:
                        assert clock is not None
                        clock.remove(self)
                    if sender is not None:
                        sender.cancel()
                    receiver.cancel()
        finally:
            await self.client.close()
        return self.records

    async def _turns(self) -> None:
        cfg = self.cfg
        keep_s = cfg.keep_audio_s if cfg.save_audio is not None else 0.0
        gaps = turn_gaps(cfg, self.index)
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
                backchannel=cfg.backchannel,
                threshold_dbfs=cfg.threshold_dbfs,
                keep_audio_s=keep_s,
            )
            self.tracker = tracker
            self.play(clip, tracker.speech_started, tracker.speech_ended)
            # The limit counts from the end of the clip: the caller's own speech is not the
            # server's time, and a long clip would otherwise leave a reply too little of it.
            timed_out = not await self._wait(tracker, time.monotonic() + clip.duration_s + cfg.timeout_s)
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
            await asyncio.sleep(next(gaps))  # silence keeps streaming meanwhile

    def _reason(self, tracker: TurnTracker) -> str | None:
        return f"connection closed: {self.closed}" if self.closed is not None else None

    async def _wait(self, tracker: TurnTracker, deadline: float) -> bool:
        """Until the turn is over (True) or the deadline (False). Sleeps until the
        receiver or sender wakes it, or the next time-based decision is due."""
        cfg = self.cfg
        while (now := time.monotonic()) < deadline:
            self._wake.clear()
            if self.closed is not None:
                return True  # finish() records why
            if tracker.barge_due(now):
                nxt = cfg.barge_clip or cfg.clips[(tracker.record.turn + 1) % len(cfg.clips)]
                self.play(nxt, tracker.barge_speech_started, tracker.barge_clip_ended)
            if tracker.finished(now):
                return True
            wake_at = min(deadline, now + _WAKE_S, tracker.next_decision(now))
            if wake_at > now:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wake_at - now)
        return False


@dataclass
class ProbeStats:
    """What the probe itself cost during a level: the error it adds, the CPU it took."""

    workers: int
    sessions: int
    wall_s: float
    cpu_s: float  # user + system CPU of the probe's processes during the level
    ticks: int
    skipped_frames: int
    tick_late_ms: dict[str, float | int | None]  # how late the frame clocks ran

    def as_dict(self) -> dict[str, Any]:
        per = self.cpu_s / self.wall_s / self.sessions if self.wall_s and self.sessions else None
        return {
            "workers": self.workers,
            "sessions": self.sessions,
            "wall_s": round(self.wall_s, 2),
            "cpu_s": round(self.cpu_s, 2),
            "cores": round(self.cpu_s / self.wall_s, 3) if self.wall_s else None,
            "cpu_per_session_pct": None if per is None else round(100 * per, 3),
            "ticks": self.ticks,
            "skipped_frames": self.skipped_frames,
            "tick_late_ms": self.tick_late_ms,
        }


@dataclass
class LevelResult:
    records: list[TurnRecord]
    stats: ProbeStats


def start_offsets(cfg: ProbeConfig, count: int) -> list[float]:
    """When each of sessions 0..count-1 starts, in seconds after the level's t0; the same in
    every worker process (a seeded draw), session 0 first."""
    if cfg.arrivals == "even":
        return [i * cfg.stagger_s for i in range(count)]
    gaps = np.random.default_rng(cfg.seed).exponential(cfg.stagger_s, count)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


def turn_gaps(cfg: ProbeConfig, index: int) -> Iterator[float]:
    """The silences session ``index`` leaves after each reply before its next turn."""
    if cfg.arrivals == "even":
        while True:
            yield cfg.gap_s
    rng = np.random.default_rng([cfg.seed, index])
    while True:
        yield float(rng.exponential(cfg.gap_s))


async def _run_sessions(
    cfg: ProbeConfig, indices: list[int], level: int, t0: float
) -> tuple[list[TurnRecord], float, int, int, list[float]]:
    """Sessions ``indices`` of a level on this loop, session i starting at
    ``t0 + i * stagger_s``; returns records, CPU seconds, ticks, skipped, lateness."""
    cpu0 = time.process_time()
    clock = FrameClock(cfg.frame_ms / 1000.0)

    offsets = start_offsets(cfg, max(indices, default=0) + 1)

    async def one(i: int) -> list[TurnRecord]:
        delay = t0 + offsets[i] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        return await _Session(cfg, i, level).run(clock)

    ticker = asyncio.create_task(clock.run(), name="probe-frame-clock")
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(i)) for i in indices]
    finally:
        ticker.cancel()
        await asyncio.wait([ticker])
    records = [r for t in tasks for r in t.result()]
    return records, time.process_time() - cpu0, clock.ticks, clock.skipped, clock.late_ms


def _worker_main(cfg: ProbeConfig, indices: list[int], level: int, conn: Any) -> None:
    """Entry of a worker process: report ready, wait for t0, run, send the results."""
    try:
        try:
            import uvloop

            loop_factory: Any = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
        conn.send(("ready",))
        t0 = conn.recv()
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            result = runner.run(_run_sessions(cfg, indices, level, t0))
        conn.send(("done", result))
    except BaseException:  # reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


async def _run_in_workers(cfg: ProbeConfig, sessions: int, workers: int) -> LevelResult:
    ctx = multiprocessing.get_context("spawn")  # no forked copy of the parent's loop
    procs, conns = [], []
    for w in range(workers):
        parent, child = ctx.Pipe()
        indices = list(range(w, sessions, workers))
        proc = ctx.Process(
            target=_worker_main, args=(cfg, indices, sessions, child), name=f"probe-{w}", daemon=True
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    try:
        for conn in conns:  # every worker imported and waiting
            msg = await asyncio.to_thread(conn.recv)
            if msg[0] != "ready":
                raise RuntimeError(f"probe worker failed to start:\n{msg[1]}")
        t0 = time.monotonic() + _START_MARGIN_S
        for conn in conns:
            conn.send(t0)
        results = []
        for conn in conns:
            msg = await asyncio.to_thread(conn.recv)
            if msg[0] != "done":
                raise RuntimeError(f"probe worker failed:\n{msg[1]}")
            results.append(msg[1])
        wall = time.monotonic() - t0
    finally:
        for proc in procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()
    records = [r for res in results for r in res[0]]
    late = [x for res in results for x in res[4]]
    stats = ProbeStats(
        workers=workers,
        sessions=sessions,
        wall_s=wall,
        cpu_s=sum(res[1] for res in results),
        ticks=sum(res[2] for res in results),
        skipped_frames=sum(res[3] for res in results),
        tick_late_ms=percentiles(late),
    )
    return LevelResult(records, stats)


async def run_level_measured(cfg: ProbeConfig, sessions: int) -> LevelResult:
    """``sessions`` concurrent callers, started ``stagger_s`` apart, and the probe's cost."""
    workers = max(1, min(cfg.workers, sessions))
    if workers > 1:
        result = await _run_in_workers(cfg, sessions, workers)
    else:
        t0 = time.monotonic()
        records, cpu, ticks, skipped, late = await _run_sessions(
            cfg, list(range(sessions)), sessions, t0
        )
        stats = ProbeStats(1, sessions, time.monotonic() - t0, cpu, ticks, skipped, percentiles(late))
        result = LevelResult(records, stats)
    result.records.sort(key=lambda r: (r.session, r.turn))
    return result


async def run_level(cfg: ProbeConfig, sessions: int) -> list[TurnRecord]:
    """``sessions`` concurrent callers, started ``stagger_s`` apart."""
    return (await run_level_measured(cfg, sessions)).records
