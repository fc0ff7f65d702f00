"""One user turn as the caller experiences it: a synchronous state machine fed with
timestamped audio and events, no I/O (the driver in ``client`` does that).

Voice-to-voice latency is measured from the audio itself: the send time of the frame
holding the clip's last sample above -40 dBFS, to the arrival of the first received
reply block above -40 dBFS. The server's own ``turn.timings`` are kept beside it.

A turn fails when the caller was not answered, and also when the server talked over
them: reply audio heard before the caller finished their clip (the server took a
pause for the end of their turn). Every failure says why in ``errors``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from voicebot.audio import pcm16_to_float
from voicebot.probe.measure import THRESHOLD_DBFS, OnsetDetector

# A response.done with one of these ends the wait; "cancelled" is a speculative reply
# the server dropped because the caller went on talking, so the turn is not over.
_FINAL = ("completed", "failed")


@dataclass
class TurnRecord:
    """What the report keeps of a turn (JSON via dataclasses.asdict)."""

    session: int
    turn: int
    audio: str
    status: str = "pending"  # ok | failed | timeout
    transcript: str = ""
    reply_text: str = ""  # full_text of the reply heard first
    heard_text: str = ""  # the part the server says was played
    voice_to_voice_ms: float | None = None
    # When the caller's speech ended, on the wall clock (s since the epoch): the one clock the
    # probe's processes share, so turns slowed by one stall line up in time.
    speech_end_at: float | None = None
    timings: dict[str, Any] = field(default_factory=dict)  # the server's turn.timings
    # The reply's prompt and prefix-cached tokens, from its response.done (a remote LLM
    # tier reports them with its last chunk, after turn.timings went out); None: not said.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    barge_in: dict[str, float | None] | None = None  # event_ms, playout_stop_ms
    # With a backchannel spoken over the reply (--backchannel-audio): whether the reply
    # went on (completed, no barge_in) and its longest silence from the backchannel on.
    backchannel: dict[str, Any] | None = None  # resumed, paused_ms
    # Reply audio received after the end of speech: how much, over how long, the longest
    # gap between chunks. Audio / span under 1 means the reply arrived slower than real
    # time (the server's TTS or pacing fell behind): the caller heard it stall.
    reply_audio_ms: float | None = None
    reply_span_ms: float | None = None
    reply_max_gap_ms: float | None = None
    # The reply audio that had arrived when that gap began: which clause came late.
    reply_max_gap_at_ms: float | None = None
    replies: list[dict[str, Any]] = field(default_factory=list)
    # The server's view of the caller's clip: turns it ended (transcripts it sent)
    # before the clip's speech was over, and reply audio heard meanwhile (ms, audible
    # blocks only): the caller was talked over.
    early_ends: int = 0
    overlap_ms: float = 0.0
    replies_while_speaking: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Response:
    started_t: float | None = None
    audio_t: float | None = None
    done: dict[str, Any] | None = None
    done_t: float | None = None


class TurnTracker:
    def __init__(
        self,
        record: TurnRecord,
        output_rate: int,
        *,
        barge_after_s: float | None = None,
        backchannel: bool = False,
        threshold_dbfs: float = THRESHOLD_DBFS,
        timings_grace_s: float = 1.0,
        keep_audio_s: float = 60.0,
    ) -> None:
        self.record = record
        self.output_rate = output_rate
        self.barge_after_s = barge_after_s
        self.backchannel = backchannel  # what is spoken over the reply should not cut it
        self.timings_grace_s = timings_grace_s
        self._detector = OnsetDetector(output_rate, threshold_dbfs)
        self._keep = int(keep_audio_s * output_rate)
        self._audio: list[np.ndarray] = []
        self._kept = 0
        self._responses: dict[str, _Response] = {}
        self._timings: dict[str, dict[str, Any]] = {}
        self._transcripts: dict[str, str] = {}
        self._playing: str | None = None  # response whose audio is arriving now
        self.fatal = False
        self._early_transcripts: list[str] = []  # final transcripts before the end of speech
        self._unprovoked_barge_ins = 0
        self._reply_first_t: float | None = None
        self._reply_last_t: float | None = None
        self._reply_samples = 0
        self._reply_last_samples = 0
        self._reply_max_gap = 0.0
        self._reply_gap_at = 0  # samples received before the longest gap
        self.speech_start_t: float | None = None
        self.speech_end_t: float | None = None
        self.onset_t: float | None = None
        self._overlap_t: float | None = None  # when reply audio was first heard over the caller
        # barge-in
        self.barge_state = (
            "off" if barge_after_s is None else "waiting"
        )  # waiting|sent|done|skipped
        self._barged: str | None = None
        self.barge_speech_t: float | None = None
        self.barge_end_t: float | None = None
        self._barge_event_t: float | None = None
        self._last_barged_audio_t: float | None = None
        self._paused = 0.0  # longest gap in the barged reply's audio from the barge speech on

    # ----------------------------------------------------------- driver -> tracker
    def speech_started(self, t: float) -> None:
        self.speech_start_t = t

    def speech_ended(self, t: float) -> None:
        self.speech_end_t = t
        self._detector.reset()  # only audio after the end of speech counts

    def barge_speech_started(self, t: float) -> None:
        self.barge_speech_t = t

    def barge_clip_ended(self, t: float) -> None:
        self.barge_end_t = t

    def on_audio(self, pcm: bytes, t: float) -> None:
        # Called for every reply chunk of every session: levels are computed only while
        # they can still change the record (the caller's speech, or the wait for the
        # onset), and audio is copied only when it is kept (--save-audio).
        if self._kept < self._keep:  # recorded for --save-audio, capped per turn
            part = pcm16_to_float(pcm)[: self._keep - self._kept]
            self._audio.append(part)
            self._kept += part.size
        if self.speech_end_t is None:
            loud = self._detector.loud_ms(pcm)
            if loud:
                self.record.overlap_ms += loud
                if self._overlap_t is None:
                    self._overlap_t = t
                if self._playing is not None and self._playing not in self.record.replies_while_speaking:
                    self.record.replies_while_speaking.append(self._playing)
        elif self.onset_t is None and self._detector.feed_pcm16(pcm):
            self.onset_t = t
        if self.barge_speech_t is not None and self._playing == self._barged:
            since = max(self.barge_speech_t, self._last_barged_audio_t or self.barge_speech_t)
            self._paused = max(self._paused, t - since)
            self._last_barged_audio_t = t
        if self.speech_end_t is not None:
            if self._reply_first_t is None:
                self._reply_first_t = t
            elif self._reply_last_t is not None and t - self._reply_last_t > self._reply_max_gap:
                self._reply_max_gap = t - self._reply_last_t
                self._reply_gap_at = self._reply_samples
            self._reply_last_t = t
            self._reply_samples += len(pcm) // 2
            self._reply_last_samples = len(pcm) // 2

    def on_event(self, data: dict[str, Any], t: float) -> None:
        kind = data.get("type")
        rid = str(data.get("response_id", ""))
        if kind == "transcript.final":
            self._transcripts[str(data.get("item_id"))] = str(data.get("text", ""))
            if self.speech_end_t is None and self.barge_speech_t is None:
                self._early_transcripts.append(str(data.get("text", "")))
        elif kind == "response.started":
            self._responses.setdefault(rid, _Response()).started_t = t
        elif kind == "response.audio.started":
            self._responses.setdefault(rid, _Response()).audio_t = t
            self._playing = rid
        elif kind == "response.done":
            resp = self._responses.setdefault(rid, _Response())
            resp.done, resp.done_t = data, t
        elif kind == "turn.timings":
            self._timings[rid] = {k: v for k, v in data.items() if k not in ("type", "response_id")}
        elif kind == "barge_in":
            if self.barge_speech_t is not None and self._barge_event_t is None:
                self._barge_event_t = t
            elif self.barge_speech_t is None:
                self._unprovoked_barge_ins += 1
        elif kind == "error":
            self.record.errors.append(f"{data.get('code')}: {data.get('message')}")
            self.fatal = self.fatal or bool(data.get("fatal"))

    # ------------------------------------------------------------ driver queries
    def barge_due(self, now: float) -> bool:
        """Time to speak over the reply? (once per turn)"""
        if self.barge_state != "waiting" or self.onset_t is None or self.barge_after_s is None:
            return False
        playing = self._responses.get(self._playing or "")
        if playing is not None and playing.done is not None:
            self.barge_state = "skipped"
            self.record.notes.append("reply ended before the barge-in was due")
            return False
        if now - self.onset_t < self.barge_after_s:
            return False
        self.barge_state = "sent"
        self._barged = self._playing
        return True

    def next_decision(self, now: float) -> float:
        """The next time :meth:`barge_due` or :meth:`finished` may change its answer
        without any new audio or event (the driver sleeps until then or a wake-up)."""
        times = [float("inf")]
        if self.barge_state == "waiting" and self.onset_t is not None and self.barge_after_s is not None:
            times.append(self.onset_t + self.barge_after_s)
        done = self._final_done()
        if done is not None and done.done_t is not None:
            times.append(done.done_t + self.timings_grace_s)
        return max(now, min(times))

    def finished(self, now: float) -> bool:
        if self.fatal:
            return True
        if self.barge_state == "waiting" and self.onset_t is None and self._final_done() is None:
            return False
        if self.barge_state == "waiting" and self.onset_t is not None:
            return False  # barge_due() decides, skipping it if the reply ends first
        if self.barge_state == "sent" and self.barge_end_t is None:
            return False
        done = self._final_done()
        if done is None:
            return False
        if any(r.started_t is not None and r.done is None for r in self._responses.values()):
            return False  # a reply is still open (say, to the barge-in clip)
        primary = self._primary()
        return (
            primary is None
            or primary in self._timings
            or now - (done.done_t or now) >= self.timings_grace_s
        )

    def _finish_backchannel(self, rec: TurnRecord) -> None:
        barged = self._responses.get(self._barged or "")
        status = (barged.done or {}).get("status") if barged is not None else None
        resumed = self._barge_event_t is None and status == "completed"
        rec.backchannel = {"resumed": resumed, "paused_ms": round(1000.0 * self._paused, 1)}
        if self._barge_event_t is not None:
            rec.errors.append("the backchannel spoken over the reply cut it (barge_in)")
        elif status != "completed":
            rec.errors.append(f"the reply did not go on after the backchannel (status {status})")

    def _last_speech_t(self) -> float | None:
        return self.barge_end_t if self.barge_state == "sent" else self.speech_end_t

    def _final_done(self) -> _Response | None:
        """A completed/failed reply that ended after the caller stopped talking."""
        since = self._last_speech_t()
        if since is None:
            return None
        for resp in self._responses.values():
            if (
                resp.done is not None
                and resp.done.get("status") in _FINAL
                and (resp.done_t or 0) >= since
            ):
                return resp
        return None

    def _primary(self) -> str | None:
        """The reply the caller heard first after the end of speech."""
        end = self.speech_end_t
        heard = [(r.audio_t, rid) for rid, r in self._responses.items() if r.audio_t is not None]
        after = sorted(x for x in heard if end is not None and x[0] is not None and x[0] >= end)
        if after:
            return after[0][1]
        if heard:  # it started before our end-of-speech (the server cut in early)
            return sorted(x for x in heard if x[0] is not None)[-1][1]
        for rid, r in self._responses.items():
            if r.done is not None and r.done.get("status") != "cancelled":
                return rid
        return None

    def _talked_over(self) -> str:
        """Why a turn whose reply was heard over the caller failed: how much, where in
        their speech it began, and the words the server had taken for the whole turn."""
        why = f"talked over the caller: {self.record.overlap_ms:.0f} ms of reply audio while they were still speaking"
        at, start, end = self._overlap_t, self.speech_start_t, self.speech_end_t
        if at is not None and start is not None and end is not None:
            why += f", from {max(0.0, at - start):.1f} s into their speech ({max(0.0, end - at):.1f} s before its end)"
        if self._early_transcripts:
            why += f"; the server had ended their turn after {self._early_transcripts[0]!r}"
        return why

    def _timeout_reason(self) -> str:
        """What the turn was still waiting for when its time ran out."""
        if self.speech_end_t is None:
            return "turn timed out before the caller's clip ended"
        open_replies = [r for r in self._responses.values() if r.started_t is not None and r.done is None]
        if self.onset_t is None:
            if open_replies:
                return "turn timed out: a reply started but no audible reply came after the end of speech"
            return "turn timed out: no reply after the end of speech (no response.started)"
        heard = self._reply_samples / self.output_rate
        if open_replies:
            return f"turn timed out: the reply was still playing ({heard:.1f} s of reply audio so far; too long a reply)"
        return "turn timed out: waiting for the reply's response.done"

    # ------------------------------------------------------------------- result
    def reply_audio(self) -> np.ndarray:
        return np.concatenate(self._audio) if self._audio else np.zeros(0, dtype=np.float32)

    def finish(
        self, now: float, *, timed_out: bool = False, reason: str | None = None
    ) -> TurnRecord:
        rec = self.record
        if reason:
            rec.errors.append(reason)
        rec.transcript = " | ".join(t for t in self._transcripts.values() if t)
        primary = self._primary()
        if primary is not None:
            resp = self._responses[primary]
            if resp.done is not None:
                rec.reply_text = str(resp.done.get("full_text", ""))
                rec.heard_text = str(resp.done.get("text", ""))
                if resp.done.get("input_tokens"):
                    rec.prompt_tokens = int(resp.done["input_tokens"])
                    rec.cached_tokens = int(resp.done.get("cached_tokens") or 0)
            rec.timings = self._timings.get(primary, {})
        rec.replies = [
            {
                "response_id": rid,
                "status": (r.done or {}).get("status"),
                "text": (r.done or {}).get("full_text"),
            }
            for rid, r in self._responses.items()
        ]
        if self.speech_end_t is not None:
            rec.speech_end_at = round(time.time() - (now - self.speech_end_t), 3)
        if self.speech_end_t is not None and self.onset_t is not None:
            rec.voice_to_voice_ms = round(1000.0 * (self.onset_t - self.speech_end_t), 1)
        if self._reply_first_t is not None and self._reply_last_t is not None:
            rec.reply_audio_ms = round(1000.0 * self._reply_samples / self.output_rate, 1)
            # the last chunk counts as played through its own length
            last = self._reply_last_samples / self.output_rate
            rec.reply_span_ms = round(1000.0 * (self._reply_last_t - self._reply_first_t + last), 1)
            rec.reply_max_gap_ms = round(1000.0 * self._reply_max_gap, 1)
            rec.reply_max_gap_at_ms = round(1000.0 * self._reply_gap_at / self.output_rate, 1)
        rec.early_ends = len(self._early_transcripts)
        rec.overlap_ms = round(rec.overlap_ms, 1)
        if rec.early_ends:
            cuts = "; ".join(repr(t) for t in self._early_transcripts)
            rec.notes.append(f"the server ended the turn {rec.early_ends} time(s) before the caller finished, after {cuts}")
        if rec.overlap_ms:
            rec.errors.append(self._talked_over())
        if self._unprovoked_barge_ins:
            rec.notes.append(
                f"{self._unprovoked_barge_ins} barge-in(s) the probe did not make: the caller went on "
                "speaking over a reply the server had started early"
            )
        if self.barge_state == "sent" and self.barge_speech_t is not None and self.backchannel:
            self._finish_backchannel(rec)
        elif self.barge_state == "sent" and self.barge_speech_t is not None:
            t0 = self.barge_speech_t
            rec.barge_in = {
                "event_ms": None
                if self._barge_event_t is None
                else round(1000.0 * (self._barge_event_t - t0), 1),
                # no barged audio after our speech began: playout had already stopped
                "playout_stop_ms": round(
                    1000.0 * max(0.0, (self._last_barged_audio_t or t0) - t0), 1
                ),
            }
            if self._barge_event_t is None:
                rec.errors.append("no barge_in event after speaking over the reply")
        done = self._final_done()
        if done is not None and done.done is not None and done.done.get("status") == "failed":
            rec.errors.append("reply failed")
        if timed_out and not self.finished(now):
            rec.status = "timeout"
            rec.errors.append(self._timeout_reason())
        elif self.fatal or rec.voice_to_voice_ms is None or done is None or rec.errors:
            rec.status = "failed"
            if rec.voice_to_voice_ms is None and not rec.errors:
                rec.errors.append("no audible reply after the end of speech")
        else:
            rec.status = "ok"
        return rec
