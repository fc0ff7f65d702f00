"""Audio at the WebRTC edge: the outbound reply track and frame <-> float32 helpers.

aiortc pulls outbound audio: its RTP sender awaits ``track.recv()`` in a loop and
Opus-encodes whatever frame comes back. :class:`ReplyTrack` answers with 20 ms frames
at 48 kHz on the track's own clock (one frame per 20 ms of wall time), taken from a
bounded queue that the session's already-paced ``ResponseAudio`` fills, and silence
when the queue is empty, so the RTP timestamps stay continuous between replies.

The call asks its session for replies at 48 kHz (Opus' native rate), so the session's
one resampling step already lands there and the track's ReplyResampler (the convention
every transport follows, voicebot/audio.py) is a pass-through.

The track's clock in :meth:`ReplyTrack.recv` is RTP media clocking (aiortc pulls one
frame per 20 ms, silence included, and the timestamps must stay continuous), not the
pacing of voicebot/transports/pacing.py, and stays here.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import deque
from typing import Protocol

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from voicebot.audio import ReplyResampler
from voicebot.wire.av_frames import pcm16_frame

log = logging.getLogger(__name__)

RATE = 48_000  # Opus' clock; aiortc encodes and decodes at this rate
FRAME = RATE // 50  # 20 ms, one Opus packet
_TIME_BASE = fractions.Fraction(1, RATE)
_RESYNC_S = 0.2  # a clock this far behind (CPU starved) restarts instead of bursting
_SILENCE = np.zeros(FRAME, dtype=np.int16)


class TrackListener(Protocol):
    """What the track reports as frames actually leave for the wire."""

    def audio_started(self, response_id: str) -> None: ...

    def audio_sent(self, response_id: str, ms: int) -> None: ...

    def audio_stopped(self, response_id: str) -> None: ...


def _to_int16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1.0, 32767.0 / 32768.0) * 32768.0).astype(np.int16)


class ReplyTrack(MediaStreamTrack):
    """The bot's voice: queued reply frames at real time, silence in between."""

    kind = "audio"

    def __init__(self, *, max_queue_ms: int = 2000, listener: TrackListener | None = None) -> None:
        super().__init__()
        self.listener = listener
        # Bounded: the session paces replies only ``playout_lead_ms`` ahead, so a full
        # queue means the peer stopped pulling; the oldest (stalest) frames go first.
        self._queue: deque[tuple[str, np.ndarray]] = deque(maxlen=max(1, max_queue_ms // 20))
        self._rid: str | None = None  # the reply being cut into frames
        self._audio = ReplyResampler(RATE)
        self._pending = np.zeros(0, dtype=np.float32)  # < one frame, waiting for more
        self._finished: set[str] = set()  # replies whose last sample is queued
        self._dead: deque[str] = deque(maxlen=8)  # flushed replies: late audio is dropped
        self._playing: str | None = None  # reply whose frames are going out
        self._sent: dict[str, int] = {}  # samples sent per reply still playing
        self._start: float | None = None
        self._pts = 0
        self.dropped_frames = 0

    # ------------------------------------------------------------ producer side
    def push(self, response_id: str, audio: np.ndarray, sample_rate: int) -> None:
        """Queue reply audio (float32 mono at ``sample_rate``)."""
        if response_id in self._dead:
            return
        if response_id != self._rid:
            self._close_reply()  # one reply plays at a time; a new one ends the last
            self._rid = response_id
        self._append(self._audio.process(response_id, audio, sample_rate))

    def finish(self, response_id: str) -> None:
        """The reply is complete: queue its resampler tail, padded to a whole frame."""
        if response_id == self._rid:
            self._close_reply()
        self._dead.append(response_id)  # late audio of a finished reply is dropped
        if response_id == self._playing or any(r == response_id for r, _ in self._queue):
            self._finished.add(response_id)  # bounded: at most the replies still queued
        if self._playing == response_id and not self._queue:
            self._stop_playing()

    def flush(self) -> int:
        """Barge-in: drop everything queued; returns the ms dropped."""
        dropped = len(self._queue) * 20
        if self._rid is not None:
            self._dead.append(self._rid)
        self._queue.clear()
        self._rid = None
        self._audio.reset()
        self._pending = np.zeros(0, dtype=np.float32)
        self._finished.clear()
        self._sent.clear()
        self._playing = None
        return dropped

    @property
    def queued_ms(self) -> int:
        return len(self._queue) * 20

    def _close_reply(self) -> None:
        if self._rid is None:
            return
        tail = self._audio.flush()
        rest = np.concatenate([self._pending, tail])
        if rest.size % FRAME:
            rest = np.concatenate([rest, np.zeros(FRAME - rest.size % FRAME, dtype=np.float32)])
        self._pending = rest
        self._cut_frames(self._rid)
        self._rid = None

    def _append(self, audio: np.ndarray) -> None:
        self._pending = np.concatenate([self._pending, audio]) if self._pending.size else audio
        assert self._rid is not None
        self._cut_frames(self._rid)

    def _cut_frames(self, rid: str) -> None:
        n = self._pending.size // FRAME
        for i in range(n):
            if len(self._queue) == self._queue.maxlen:
                self.dropped_frames += 1
                if self.dropped_frames == 1:
                    log.warning("reply track queue full: dropping the oldest audio")
            self._queue.append((rid, _to_int16(self._pending[i * FRAME : (i + 1) * FRAME])))
        self._pending = self._pending[n * FRAME :]

    # ------------------------------------------------------------ consumer side
    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        else:
            self._pts += FRAME
            wait = self._start + self._pts / RATE - now
            if wait > 0:
                await asyncio.sleep(wait)
            elif wait < -_RESYNC_S:
                self._start = now - self._pts / RATE  # resync: late frames are not burst out
        return pcm16_frame(self._next_samples(), RATE, self._pts)

    def _next_samples(self) -> np.ndarray:
        if not self._queue:
            if self._playing is not None and self._playing in self._finished:
                self._stop_playing()
            return _SILENCE
        rid, samples = self._queue.popleft()
        if rid != self._playing:
            if self._playing is not None:
                self._stop_playing()
            self._playing = rid
            self._sent[rid] = 0
            if self.listener is not None:
                self.listener.audio_started(rid)
        self._sent[rid] = self._sent.get(rid, 0) + FRAME
        if self.listener is not None and rid not in self._finished:
            self.listener.audio_sent(rid, self._sent[rid] * 1000 // RATE)
        if not self._queue and rid in self._finished:
            self._stop_playing()
        return samples

    def _stop_playing(self) -> None:
        rid, self._playing = self._playing, None
        if rid is None:
            return
        self._sent.pop(rid, None)
        self._finished.discard(rid)
        if self.listener is not None:
            self.listener.audio_stopped(rid)
