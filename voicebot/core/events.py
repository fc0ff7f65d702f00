"""What the call core is told (events) and what it decides (actions).

Plain frozen dataclasses: no audio, no engine objects, so a call's events can be
recorded and replayed. ``options`` fields carry a client's per-reply overrides through
the core untouched (the core never reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ----------------------------------------------------------------------- events


@dataclass(frozen=True)
class Started:
    """The call's tasks can run: background work may start."""


@dataclass(frozen=True)
class Closing:
    """The call is ending: nothing new starts."""


# Turn signals from the detector (voicebot/session/turns.py).
@dataclass(frozen=True)
class SpeechStart:
    pass


@dataclass(frozen=True)
class Quiet:
    pass


@dataclass(frozen=True)
class Pause:
    pass


@dataclass(frozen=True)
class Resume:
    pass


@dataclass(frozen=True)
class TurnEnd:
    pass


@dataclass(frozen=True)
class Partial:
    """A partial transcript of the open turn."""

    text: str
    confirmed: str = ""
    tentative: str = ""


@dataclass(frozen=True)
class Transcribed:
    """A turn's final transcript is ready (empty: nothing was said)."""

    item_id: str
    text: str


@dataclass(frozen=True)
class ReplyEnded:
    """A reply's work is over. ``text`` None: dropped unheard, nothing to keep or
    report; otherwise what the history keeps (``token_ids``: as the model produced
    it). ``computed``: the tokens its request left in the prefix cache."""

    reply_id: str
    status: str
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    computed: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ReplyShown:
    """The client is told of the released reply now: its first audio is going out (or,
    with no audio, its text or its end). From here on speech over it is a barge-in; before,
    it withdraws the reply unheard (``reopen_unheard``)."""

    reply_id: str


@dataclass(frozen=True)
class ReplyWritten:
    """The released reply's LLM and TTS work is done (no tool round follows) and
    ``audio_s`` seconds of its audio are still to go out: the caller listens, the LLM is
    free."""

    reply_id: str
    audio_s: float


@dataclass(frozen=True)
class ToolResults:
    """A completed reply's server tools ran and their results are in the history: the
    next round answers them."""

    reply_id: str
    options: Any = None
    tool_round: int = 0


# Client commands.
@dataclass(frozen=True)
class Commit:
    item_id: str


@dataclass(frozen=True)
class Clear:
    pass


@dataclass(frozen=True)
class CreateReply:
    options: Any = None


@dataclass(frozen=True)
class CancelReply:
    status: str = "cancelled"
    report: bool = True


@dataclass(frozen=True)
class AddItem:
    role: str
    text: str
    item_id: str
    call_id: str | None = None
    tool_calls: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class ContextChanged:
    """The system prompt or the tools changed: the prompt's start is new."""


@dataclass(frozen=True)
class SettingsChanged:
    create_response: bool
    interrupt_response: bool


# Background work.
@dataclass(frozen=True)
class PrefillProgress:
    prefill: int
    end: int  # tokens of its ids now in the cache


@dataclass(frozen=True)
class PrefillDone:
    prefill: int
    ok: bool = True


@dataclass(frozen=True)
class SummaryDone:
    summary: int
    text: str | None  # None: it failed


@dataclass(frozen=True)
class Tick:
    """The time a :class:`WakeAt` asked for has come."""


Event = (
    Started | Closing | SpeechStart | Quiet | Pause | Resume | TurnEnd | Partial | Transcribed | ReplyEnded
    | ReplyShown | ReplyWritten | ToolResults | Commit | Clear | CreateReply | CancelReply | AddItem
    | ContextChanged | SettingsChanged | PrefillProgress | PrefillDone | SummaryDone | Tick
)

# ---------------------------------------------------------------------- actions


@dataclass(frozen=True)
class OpenTurn:
    """The caller started speaking: a new turn, its audio from the pre-speech padding.
    ``announce`` False: speech over a paused reply, not yet known to be a turn; the
    client is told of it (:class:`AnnounceTurn`) only once it is one."""

    item_id: str
    announce: bool = True


@dataclass(frozen=True)
class AnnounceTurn:
    """Speech over a paused reply is a turn after all: tell the client of it now (its
    start, and its end if it ended already)."""

    item_id: str


@dataclass(frozen=True)
class ForgetTurn:
    """Speech over a paused reply was no turn (a backchannel, a noise): the client is
    never told of it."""

    item_id: str


@dataclass(frozen=True)
class RequestPartial:
    pass


@dataclass(frozen=True)
class EmitPartial:
    item_id: str
    confirmed: str
    tentative: str


@dataclass(frozen=True)
class StartFinal:
    """Decode the open turn's final transcript (answer with :class:`Transcribed`)."""

    item_id: str


@dataclass(frozen=True)
class CancelFinal:
    item_id: str


@dataclass(frozen=True)
class EndTurn:
    """The caller's turn is over: report it; its final transcript completes it.
    ``held``: the client is told of its end (and of its transcript) only at
    :class:`RevealTurn`, when its reply is heard; until then it may reopen."""

    item_id: str
    held: bool = False


@dataclass(frozen=True)
class RevealTurn:
    """Tell the client now of the held end of the turn, and of its transcript if it is in."""

    item_id: str


@dataclass(frozen=True)
class ReopenTurn:
    """The caller went on before a word of the turn's reply was heard: the turn is open
    again, its audio so far kept (one utterance, one transcript), its held end never told."""

    item_id: str


@dataclass(frozen=True)
class CommitTurn:
    """A client's turn: the audio so far leaves with its own stream and decode."""

    item_id: str


@dataclass(frozen=True)
class ResetInput:
    pass


@dataclass(frozen=True)
class TurnTranscribed:
    item_id: str
    text: str


@dataclass(frozen=True)
class StartReply:
    reply_id: str
    item_id: str
    turn: str | None  # the user turn it answers (its transcript is its prompt's end)
    gated: bool
    options: Any = None
    tool_round: int = 0
    # Speech before its first audio withdraws it (reopen_unheard): the client is told of
    # it only with that audio (or its end, if it has none).
    withdrawable: bool = False


@dataclass(frozen=True)
class ReleaseReply:
    reply_id: str


@dataclass(frozen=True)
class PauseReply:
    """Speech started over the reply: stop sending its audio, keep the rest queued."""

    reply_id: str


@dataclass(frozen=True)
class ResumeReply:
    """The speech was no turn: send the paused reply's audio on from where it stopped."""

    reply_id: str


@dataclass(frozen=True)
class StopReply:
    """Cancel the reply's work; answer with :class:`ReplyEnded` (text: what was heard
    when ``report``, else None)."""

    reply_id: str
    status: str
    report: bool


@dataclass(frozen=True)
class ReportReply:
    """The reply is in the history: tell the client it is done."""

    reply_id: str
    status: str


@dataclass(frozen=True)
class StartPrefill:
    """Prefill ``ids`` at background priority; the first ``cached`` are cached."""

    prefill: int
    ids: tuple[int, ...]
    cached: int


@dataclass(frozen=True)
class CancelPrefill:
    prefill: int


@dataclass(frozen=True)
class StartSummary:
    """Summarise ``messages`` (after ``earlier``) at background priority."""

    summary: int
    messages: tuple[Any, ...]
    earlier: str | None


@dataclass(frozen=True)
class CancelSummary:
    summary: int


@dataclass(frozen=True)
class WakeAt:
    """Feed :class:`Tick` at ``at`` (seconds, the call's clock): background work held back
    until then may start. A later one replaces it."""

    at: float


Action = (
    OpenTurn | AnnounceTurn | ForgetTurn | RequestPartial | EmitPartial | StartFinal | CancelFinal | EndTurn
    | RevealTurn | ReopenTurn | CommitTurn | ResetInput | TurnTranscribed | StartReply | ReleaseReply | PauseReply | ResumeReply | StopReply | ReportReply | StartPrefill
    | CancelPrefill | StartSummary | CancelSummary | WakeAt
)
