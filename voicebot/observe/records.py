"""A call's record: one JSON document per ended call, built from what the call reports.

:class:`CallRecorder` is a :class:`~voicebot.session.observer.CallObserver` that only
accumulates plain data (no I/O); :meth:`CallRecorder.document` is the record. Its size
is bounded by ``telemetry.max_turns`` and ``telemetry.max_text_chars`` whatever the
call does. The format is described in docs/operations.md ("The call record").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from voicebot.session import events as ev
from voicebot.session.observer import AudioTap, TurnStages

RECORD_VERSION = 1

# The reasons a call ends with when the caller (or its client) let go of it; every
# other reason is the server's doing (shutdown, idle, an error, a client too slow).
CALLER_REASONS = frozenset({
    "closed",  # a call closed through the API with no reason (in-process clients)
    "client closed",  # a WebSocket client closed (native, Realtime)
    "hangup",  # WebRTC: the client hung up
    "call ended",  # Twilio/Telnyx: the stream stopped (the caller hung up)
    "hangup digit",  # Twilio/Telnyx: the caller pressed the hang-up key
    "data channel closed",
    "mic track ended",
})

_MAX_ERRORS = 100  # errors kept in one record (the first ones)
_MAX_REPLIES_PER_TURN = 32  # tool rounds and client-created replies under one turn
_MAX_DETAILS = 16  # what a transport tells of a call: a few ids and numbers
# Replies ended that a client can still truncate (as many as the session keeps).
_RECENT_REPLIES = 4


def hung_up_by(reason: str) -> str:
    """"caller" or "server", from the reason the call ended with."""
    return "caller" if reason in CALLER_REASONS else "server"


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class _Turn:
    item_id: str | None
    transcript: str | None
    at_s: float
    replies: list[dict[str, Any]] = field(default_factory=list)
    replies_left_out: int = 0


class CallRecorder:
    """Builds one call's record from its events; a CallObserver."""

    def __init__(self, *, max_turns: int, max_text_chars: int) -> None:
        self._max_turns = max_turns
        self._max_chars = max_text_chars
        self.call_id = ""
        self.transport = ""
        self._mono0 = 0.0
        self._wall0 = 0.0
        self._ended: tuple[str, float] | None = None
        self._turns: list[_Turn] = []
        self._turns_left_out = 0
        self._replies: dict[str, dict[str, Any]] = {}  # by response id, until done
        self._ended_replies: dict[str, dict[str, Any]] = {}  # the last few done, by response id
        self._timings: dict[str, dict[str, Any]] = {}  # TurnTimings by response id, until done
        self._tool_calls: dict[str, dict[str, Any]] = {}  # by call id, for their results
        self._errors: list[dict[str, Any]] = []
        self._counts = {"replies": 0, "barge_ins": 0, "tool_calls": 0, "errors": 0}
        self._tokens = {"prompt": 0, "cached": 0, "output": 0}
        self._v2v: list[float] = []
        self._details: dict[str, str] = {}
        self.audio: dict[str, Any] | None = None  # the call's WAV, when its audio is recorded

    # ------------------------------------------------------------- the seam
    def audio_tap(self) -> AudioTap | None:
        return None

    def started(self, call_id: str, transport: str, now: float) -> None:
        self.call_id, self.transport = call_id, transport
        self._mono0, self._wall0 = now, time.time()

    def details(self, fields: Mapping[str, str]) -> None:
        for key, value in list(fields.items())[:_MAX_DETAILS]:
            self._details[key[:64]] = self._cut(value)

    def event(self, event: ev.SessionEvent, now: float) -> None:
        match event:
            case ev.TranscriptFinal(item_id, text) if text.strip():
                self._open_turn(item_id, text, now)
            case ev.ResponseStarted(response_id):
                self._reply(response_id, now)
            case ev.TurnTimings():
                self._timings[event.response_id] = {
                    k: getattr(event, k) for k in (
                        "endpointing_ms", "asr_final_ms", "llm_ttft_ms", "first_clause_ms",
                        "tts_first_audio_ms", "voice_to_voice_ms", "speculative")
                }
                if event.voice_to_voice_ms is not None:
                    self._v2v.append(event.voice_to_voice_ms)
            case ev.ToolCallDone(response_id, call):
                entry: dict[str, Any] = {"call_id": call.call_id, "name": call.name,
                         "arguments": self._cut(call.arguments), "result": None}
                reply = self._reply(response_id, now)
                if reply is not None:
                    reply["tool_calls"].append(entry)
                    self._tool_calls[call.call_id] = entry
                self._counts["tool_calls"] += 1
            case ev.ToolResult(call_id, _, output):
                if (called := self._tool_calls.pop(call_id, None)) is not None:
                    called["result"] = self._cut(output)
            case ev.BargeIn(response_id, played_ms, heard):
                self._counts["barge_ins"] += 1
                if (reply := self._reply(response_id, now)) is not None:
                    reply["barge_in"] = {"at_s": self._at(now), "played_ms": played_ms, "heard": self._cut(heard)}
            case ev.ResponseDone():
                self._done(event, now)
            case ev.ReplyTruncated(response_id, _, played_ms, heard):
                reply = self._replies.get(response_id) or self._ended_replies.get(response_id)
                if reply is not None:
                    reply.update(heard=self._cut(heard), played_ms=played_ms,
                                 truncated={"at_s": self._at(now), "audio_end_ms": played_ms})
            case ev.ErrorEvent(code, message, _, fatal):
                self._counts["errors"] += 1
                if len(self._errors) < _MAX_ERRORS:
                    self._errors.append({"at_s": self._at(now), "code": code, "message": self._cut(message), "fatal": fatal})

    def stages(self, stages: TurnStages) -> None:
        self._tokens["prompt"] += stages.prompt_tokens
        self._tokens["cached"] += stages.cached_tokens
        self._tokens["output"] += stages.output_tokens

    def ended(self, reason: str, now: float) -> None:
        self._ended = (reason, now)

    # --------------------------------------------------------------- record
    @property
    def started_at(self) -> str:
        return _iso(self._wall0)

    def document(self) -> dict[str, Any]:
        """The call's record (once the call ended; a call still open reads as ending now)."""
        reason, end = self._ended or ("open", self._mono0 + (time.time() - self._wall0))
        v2v = sorted(self._v2v)
        return {
            "version": RECORD_VERSION,
            "call_id": self.call_id,
            "protocol": self.transport,
            "details": self._details,
            "started_at": self.started_at,
            "ended_at": _iso(self._wall0 + (end - self._mono0)),
            "duration_s": round(end - self._mono0, 3),
            "end_reason": reason,
            "hung_up_by": hung_up_by(reason),
            "turns": [self._turn_json(t) for t in self._turns],
            "turns_left_out": self._turns_left_out,
            "errors": self._errors,
            "audio": self.audio,
            "summary": {
                "turns": len(self._turns) + self._turns_left_out,
                **self._counts,
                "prompt_tokens": self._tokens["prompt"],
                "cached_prompt_tokens": self._tokens["cached"],
                "output_tokens": self._tokens["output"],
                "voice_to_voice_ms": {
                    "p50": round(statistics.median(v2v), 1),
                    "max": round(v2v[-1], 1),
                    "mean": round(statistics.fmean(v2v), 1),
                } if v2v else None,
            },
        }

    # ------------------------------------------------------------- helpers
    def _at(self, now: float) -> float:
        return round(now - self._mono0, 3)

    def _cut(self, text: str) -> str:
        if len(text) <= self._max_chars:
            return text
        return f"{text[:self._max_chars]}… [{len(text) - self._max_chars} more characters]"

    def _open_turn(self, item_id: str | None, text: str | None, now: float) -> _Turn | None:
        if len(self._turns) >= self._max_turns:
            self._turns_left_out += 1
            return None
        turn = _Turn(item_id, None if text is None else self._cut(text), self._at(now))
        self._turns.append(turn)
        return turn

    def _reply(self, response_id: str, now: float) -> dict[str, Any] | None:
        """The reply's entry, opened under the latest turn (a turn of its own when the
        client asked for it with no transcript before it); None once left out."""
        if response_id in self._replies:
            return self._replies[response_id]
        turn = self._turns[-1] if self._turns and self._turns_left_out == 0 else None
        if turn is None and self._turns_left_out == 0:
            turn = self._open_turn(None, None, now)
        if turn is None:
            return None
        if len(turn.replies) >= _MAX_REPLIES_PER_TURN:
            turn.replies_left_out += 1
            return None
        reply: dict[str, Any] = {
            "response_id": response_id, "at_s": self._at(now), "status": None, "text": None,
            "heard": None, "played_ms": 0, "finish_reason": None, "timings": None,
            "tokens": None, "tool_calls": [], "barge_in": None, "truncated": None,
        }
        turn.replies.append(reply)
        self._replies[response_id] = reply
        return reply

    def _done(self, done: ev.ResponseDone, now: float) -> None:
        self._counts["replies"] += 1
        reply = self._reply(done.response_id, now)
        self._replies.pop(done.response_id, None)
        timings = self._timings.pop(done.response_id, None)
        if reply is None:
            return
        self._ended_replies[done.response_id] = reply
        while len(self._ended_replies) > _RECENT_REPLIES:
            self._ended_replies.pop(next(iter(self._ended_replies)))
        reply.update(
            status=done.status,
            text=self._cut(done.full_text),
            heard=self._cut(done.text),
            played_ms=done.played_ms,
            finish_reason=done.finish_reason,
            timings=timings,
            tokens={"prompt": done.input_tokens, "cached": done.cached_tokens, "output": done.output_tokens},
            ended_s=self._at(now),
        )

    @staticmethod
    def _turn_json(turn: _Turn) -> dict[str, Any]:
        out: dict[str, Any] = {"item_id": turn.item_id, "at_s": turn.at_s, "transcript": turn.transcript,
                               "replies": turn.replies}
        if turn.replies_left_out:
            out["replies_left_out"] = turn.replies_left_out
        return out
