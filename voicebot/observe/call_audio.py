"""A call's audio, as the caller lived it: one stereo WAV beside the call record
(``telemetry.record_audio``), caller on the left, the bot on the right.

Both sides are placed on one timeline, the call's clock from its start, at 16 kHz:

- the caller's audio where it arrived: each chunk ends when it came in. A client that
  sends in real time (every phone line, browser and SDK) lands where it was said;
  gaps longer than ``JITTER_S`` (a client that stops sending while the bot speaks)
  become silence, shorter ones are network jitter and are closed up. A client that
  sends faster than real time is laid end to end, ahead of the clock.
- the bot's audio where the caller heard it: a frame plays when it is sent or when the
  frames before it have played, whichever is later. A reply cut short (a barge-in, a
  cancel, a Realtime client's truncate, even after the reply ended) keeps only what
  the call reports the caller heard of it: its audio sent but not played is taken back
  out, which is why the last ``HOLD_S`` of the timeline stay in memory before they are
  written.

:class:`StereoTimeline` is that placement, synchronous and without I/O;
:class:`CallAudio` feeds it from a call (a :class:`~voicebot.session.observer.AudioTap`
and a call observer) and hands each finished block, about every ``BLOCK_S``, to the
writer thread (voicebot/observe/audio_files.py). Memory per call is bounded by
``HOLD_S`` plus one block, whatever the length of the call.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from voicebot.audio import ASR_RATE, ReplyResampler
from voicebot.session import events as ev
from voicebot.session.observer import AudioTap, TurnStages

log = logging.getLogger(__name__)

RATE = ASR_RATE  # what the caller's side already is inside the call
CHANNELS = ("caller", "bot")
# What a cut can still take back: the session's playout lead (at most 2 s) plus the
# lag of a transport's own report of what was played (Twilio's marks).
HOLD_S = 3.0
BLOCK_S = 0.5  # written this often: small writes, and little lost in a crash
JITTER_S = 0.1  # a caller's chunk this much later than the last one's end is still contiguous
_RECENT_REPLIES = 4  # replies a client can still truncate (as many as the session keeps)


class _Channel:
    """One side's samples not written yet, as (start sample, audio) segments in order."""

    def __init__(self) -> None:
        self.segments: deque[tuple[int, np.ndarray]] = deque()
        self.end = 0  # the sample after the last one placed (or written)

    def add(self, start: int, audio: np.ndarray) -> None:
        self.segments.append((start, audio))
        self.end = start + audio.size

    def truncate(self, at: int) -> None:
        """Drop everything from sample ``at`` on."""
        self.remove(at, max(self.end, at))

    def remove(self, lo: int, hi: int) -> None:
        """Drop samples ``lo``..``hi`` (silence in their place)."""
        kept: deque[tuple[int, np.ndarray]] = deque()
        for start, audio in self.segments:
            end = start + audio.size
            if end <= lo or start >= hi:
                kept.append((start, audio))
                continue
            if start < lo:
                kept.append((start, audio[: lo - start]))
            if end > hi:
                kept.append((hi, audio[hi - start :]))
        self.segments = kept
        if hi >= self.end:
            self.end = min(self.end, lo)

    def take(self, start: int, stop: int) -> np.ndarray:
        """Samples ``start``..``stop`` (silence where nothing was placed); what lies
        before ``stop`` is forgotten."""
        out = np.zeros(stop - start, dtype=np.float32)
        while self.segments:
            seg_start, audio = self.segments[0]
            seg_end = seg_start + audio.size
            lo, hi = max(seg_start, start), min(seg_end, stop)
            if hi > lo:
                out[lo - start : hi - start] = audio[lo - seg_start : hi - seg_start]
            if seg_end > stop:
                if seg_start < stop:
                    self.segments[0] = (stop, audio[stop - seg_start :])
                break
            self.segments.popleft()
        self.end = max(self.end, stop)
        return out


class StereoTimeline:
    """Caller (left) and bot (right) placed on one timeline from the call's start
    (``start``, on the call's clock); ``take`` gives what can no longer change."""

    def __init__(self, start: float, *, rate: int = RATE, max_s: float = float("inf"),
                 hold_s: float = HOLD_S, jitter_s: float = JITTER_S) -> None:
        self.rate = rate
        self._t0 = start
        self._hold = int(hold_s * rate)
        self._jitter = int(jitter_s * rate)
        self.max_samples = int(min(max_s * rate, 2**31 // 4 - 1))  # a WAV's 4 GiB, at 4 bytes a frame
        self.left, self.right = _Channel(), _Channel()
        self.written = 0  # samples handed out by take()
        # Recent replies' [first sample, end sample], so that a cut finds its reply.
        self._replies: dict[str, list[int]] = {}
        self.truncated = False  # the call outlasted max_s: its audio past that is not kept

    def at(self, now: float) -> int:
        return int(round((now - self._t0) * self.rate))

    def caller(self, audio: np.ndarray, now: float) -> None:
        start = self.at(now) - audio.size
        place = self.left.end if start <= self.left.end + self._jitter else start
        self._place(self.left, max(place, self.written), audio)

    def bot(self, reply_id: str, audio: np.ndarray, now: float) -> None:
        place = max(self.right.end, self.at(now), self.written)
        span = self._replies.get(reply_id)
        if span is None:
            span = self._replies[reply_id] = [place, place]
            while len(self._replies) > _RECENT_REPLIES:
                self._replies.pop(next(iter(self._replies)))
        self._place(self.right, place, audio)
        span[1] = place + audio.size

    def cut(self, reply_id: str, heard_s: float) -> None:
        """Reply ``reply_id`` was heard for ``heard_s`` only: the rest of it goes
        (what was already written stays)."""
        span = self._replies.get(reply_id)
        if span is None:
            return
        at = max(span[0] + int(heard_s * self.rate), self.written)
        if at < span[1]:
            self.right.remove(at, span[1])
            span[1] = at

    def hang_up(self, now: float) -> None:
        """The call ended: bot audio sent ahead of ``now`` was never heard."""
        self.right.truncate(max(self.at(now), self.written))

    def take(self, now: float | None, block: int = 0) -> np.ndarray | None:
        """Interleaved PCM16 frames (n, 2) up to ``now`` less the hold, once there are
        ``block`` of them; ``now`` None: everything placed (the call is over)."""
        if now is None:
            stop = max(self.left.end, self.right.end)
        else:
            # A caller far ahead of the clock is written anyway: the hold stays bounded.
            stop = max(self.at(now) - self._hold, max(self.left.end, self.right.end) - 2 * self._hold)
        stop = min(stop, self.max_samples)
        if stop - self.written < max(block, 1):
            return None
        frames = np.stack([self.left.take(self.written, stop), self.right.take(self.written, stop)], axis=1)
        self.written = stop
        return (np.clip(frames, -1.0, 32767.0 / 32768.0) * 32768.0).astype("<i2")

    def _place(self, channel: _Channel, start: int, audio: np.ndarray) -> None:
        if start + audio.size > self.max_samples:
            self.truncated = True
            audio = audio[: max(0, self.max_samples - start)]
        if audio.size:
            channel.add(start, audio)


class BlockSink(Protocol):
    """Where a call's finished blocks go (audio_files.WavStream)."""

    def write(self, block: bytes) -> bool:
        """Append interleaved PCM16 frames; False when the block was dropped."""
        ...

    def close(self) -> None: ...


class CallAudio:
    """One call's audio recorder: an AudioTap for its frames and a call observer for
    its replies' ends; its blocks go to the sink it is given once the call started."""

    def __init__(self, *, max_s: float) -> None:
        self._max_s = max_s
        self._timeline: StereoTimeline | None = None
        self._sink: BlockSink | None = None
        self._block = int(BLOCK_S * RATE)
        self._resampler = ReplyResampler(RATE)
        self.name: str | None = None  # the WAV's file name
        self.lost = False  # the writer was behind: the rest of the call is not recorded
        self.closed = False

    def attach(self, name: str, sink: BlockSink) -> None:
        """The file the call's audio goes to, named beside its record."""
        self.name, self._sink = name, sink

    # ------------------------------------------------------------ the taps
    def caller(self, audio: np.ndarray, now: float) -> None:
        if self._timeline is not None and not self.closed:
            try:  # a copy: an in-process client may reuse its buffer
                self._timeline.caller(np.array(audio, dtype=np.float32), now)
                self._flush(now)
            except Exception:
                self._broken()

    def reply(self, response_id: str, audio: np.ndarray, sample_rate: int, now: float) -> None:
        if self._timeline is not None and not self.closed:
            try:
                self._timeline.bot(response_id, self._resampler.process(response_id, audio, sample_rate), now)
                self._flush(now)
            except Exception:
                self._broken()

    def _broken(self) -> None:
        """A tap runs inside the call's audio path: whatever fails here stops the
        recording, never the call."""
        log.exception("call audio recording of %s failed; the call goes on", self.name)
        self.closed = self.lost = True
        if self._sink is not None:
            self._sink.close()

    # ------------------------------------------------------- the observer
    def audio_tap(self) -> AudioTap:
        return self

    def started(self, call_id: str, transport: str, now: float) -> None:
        self._timeline = StereoTimeline(now, max_s=self._max_s)

    def details(self, fields: Mapping[str, str]) -> None:
        pass

    def event(self, event: ev.SessionEvent, now: float) -> None:
        if self._timeline is None:
            return
        match event:
            case ev.ResponseDone(response_id=rid, status="completed"):
                if self._resampler.response_id == rid:
                    self._timeline.bot(rid, self._resampler.flush(), now)
            case ev.ResponseDone(response_id=rid, played_ms=played_ms):
                self._resampler.reset()
                self._timeline.cut(rid, played_ms / 1000)
            case ev.ReplyTruncated(response_id=rid, played_ms=played_ms):
                self._timeline.cut(rid, played_ms / 1000)

    def stages(self, stages: TurnStages) -> None:
        pass

    def ended(self, reason: str, now: float) -> None:
        if self._timeline is None or self.closed:
            return
        self._timeline.hang_up(now)
        self._flush(None)
        self.closed = True
        if self._sink is not None:
            self._sink.close()

    # ------------------------------------------------------------ record
    def reference(self) -> dict[str, Any] | None:
        """What the call record says of its audio."""
        if self._sink is None or self._timeline is None:
            return None
        return {
            "file": self.name,
            "sample_rate": RATE,
            "channels": list(CHANNELS),
            "duration_s": round(self._timeline.written / RATE, 3),
            "complete": not (self.lost or self._timeline.truncated),
        }

    def _flush(self, now: float | None) -> None:
        assert self._timeline is not None
        frames = self._timeline.take(now, self._block)
        if frames is None or self.lost or self._sink is None:
            return
        if not self._sink.write(frames.tobytes()):
            self.lost = True
            log.warning("call audio writer is behind: the rest of %s is not recorded", self.name)
