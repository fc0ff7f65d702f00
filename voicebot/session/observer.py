"""The one seam through which a call reports what happened, for whoever watches calls
(traces, call records, the end-of-call webhook: voicebot/observe).

A call tells its observer four things, each on the call's clock (``now``, seconds):
it started, every event it told its client (audio frames excepted: nothing here is
per frame) and a client's truncation of a reply (``ReplyTruncated``), the marks of a
reply's stages when it ends, and why the call ended. The
observer only records; it never decides anything about the call and must not raise
(an observer that fails is the observer's problem, not the call's).

Only a call whose audio is recorded (``telemetry.record_audio``) has an
:class:`AudioTap`, which the observer hands out as the call is made: the one path that
is per audio frame, and nothing at all for every other call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from voicebot.session.events import SessionEvent


@dataclass(frozen=True)
class TurnStages:
    """A reply the caller was told of, as it ends: when each stage of it (and of the
    user turn it answers) began and ended, on the call's clock. None: the stage did not
    happen (no user turn for a reply the client asked for; no audio for a reply cut
    before it spoke)."""

    response_id: str
    status: str  # completed, interrupted, cancelled, failed
    speech_end: float | None  # the caller's last speech audio
    committed: float | None  # the end-of-turn decision
    asr_started: float | None  # the final transcript requested
    asr_done: float | None
    llm_requested: float | None
    llm_ttft_s: float | None  # the LLM's time to first token (it keeps its own clock)
    llm_done: float | None  # the last token
    first_clause: float | None
    tts_started: float | None  # synthesis of the first clause began
    tts_first_audio: float | None
    audio_started: float | None  # the first reply audio frame went to the client
    ended: float  # played out, or cut
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    speculative: bool = False


class AudioTap(Protocol):
    """A recorded call's audio, frame by frame, on the call's clock; returns at once
    and never raises."""

    def caller(self, audio: np.ndarray, now: float) -> None:
        """The caller's audio at 16 kHz, as the call takes it in."""
        ...

    def reply(self, response_id: str, audio: np.ndarray, sample_rate: int, now: float) -> None:
        """A frame of a reply's audio, as it goes to the client."""
        ...


class CallObserver(Protocol):
    """What a call reports; every method returns at once and never raises."""

    def audio_tap(self) -> AudioTap | None:
        """Where the call's audio goes, if it is recorded (asked once, as the call is made)."""
        ...

    def started(self, call_id: str, transport: str, now: float) -> None: ...

    def details(self, fields: Mapping[str, str]) -> None:
        """What the transport knows of the call beside its id: for a phone call, the
        carrier, its call and stream ids, the caller's and the called number."""
        ...

    def event(self, event: SessionEvent, now: float) -> None:
        """An event the call told its client (never a reply's audio frame), or a
        client's ``ReplyTruncated``."""
        ...

    def stages(self, stages: TurnStages) -> None: ...

    def ended(self, reason: str, now: float) -> None: ...


class NoObserver:
    """Nobody watches: the default, which costs a method call per event."""

    def audio_tap(self) -> AudioTap | None:
        return None

    def started(self, call_id: str, transport: str, now: float) -> None:
        pass

    def details(self, fields: Mapping[str, str]) -> None:
        pass

    def event(self, event: SessionEvent, now: float) -> None:
        pass

    def stages(self, stages: TurnStages) -> None:
        pass

    def ended(self, reason: str, now: float) -> None:
        pass


NO_OBSERVER: CallObserver = NoObserver()
