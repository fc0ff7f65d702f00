"""The control plane of one call, as a synchronous state machine.

:meth:`CallCore.handle` takes an :mod:`event <voicebot.core.events>` and returns the
actions to run, in order; it does no I/O and never waits. The async session
(voicebot/session/session.py) feeds it what happens (turn signals, transcripts, the
end of a reply's work, a client's commands, background work done) and runs what it
decides. Some actions ask for an answer: :class:`StartFinal` / :class:`EndTurn` /
:class:`CommitTurn` are answered by :class:`Transcribed`, :class:`StopReply` by
:class:`ReplyEnded` (at once), :class:`StartPrefill` by :class:`PrefillDone`,
:class:`StartSummary` by :class:`SummaryDone`.

It owns:
- turn-taking and speculation: when the caller pauses the final transcript is decoded
  and a reply prepared *gated*; the end of the turn releases it, speech cancels it;
- a turn taken for over too early (``reopen_unheard``): its end is told to the client
  only when its reply is heard (:class:`ReplyShown`); speech before that withdraws the
  reply unheard and reopens the turn, so the caller's words stay one utterance;
- the one live reply: started, released, cut by a barge-in (the history keeps what
  was heard), its tool rounds;
- false interruptions: speech over a reply pauses it; the speech is a turn (the reply
  is cut, the client told of both) only once its words or its length say so, and a
  backchannel or a noise resumes the reply where it paused, unseen by the client
  (:mod:`voicebot.core.backchannel`);
- the conversation's budget and background LLM work (:mod:`voicebot.core.background`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from voicebot.core import events as ev
from voicebot.core.backchannel import FalseInterruptions
from voicebot.core.background import Background, History


@dataclass
class Reply:
    id: str
    item_id: str
    turn: str | None
    released: bool
    tool_round: int = 0
    shown: bool = False  # the client was told of it (its first audio went out)
    written: bool = False  # its LLM work is done; its audio may still play


@dataclass
class _Turn:
    item_id: str
    seq: int
    reply: str | None = None  # the reply prepared for it speculatively
    committed: bool = False  # the client ended it (input commit): nothing to reopen


@dataclass
class _Overlap:
    """Speech over a released reply, not yet known to be a turn: the reply is paused
    and the client has been told of neither."""

    item_id: str  # the turn the speech opened
    reply_id: str  # the reply it paused
    speech_from: float  # when the speech began (the call's clock)
    # When it fell quiet (QUIET), until it sounds again (RESUME): its length is measured
    # to there, not to when a slow partial transcript of it arrives.
    quiet_from: float | None = None

    def length(self, now: float) -> float:
        return (self.quiet_from if self.quiet_from is not None else now) - self.speech_from


class CallCore:
    def __init__(
        self,
        history: History,
        *,
        tag: str,
        create_response: bool = True,
        interrupt_response: bool = True,
        warm_turn: bool = False,
        prefills: bool = False,
        summaries: bool = False,
        block_size: int | Callable[[], int] = 16,
        false_interruptions: FalseInterruptions | None = None,
        reopen_unheard: bool = False,
        log: logging.Logger | logging.LoggerAdapter[Any] | None = None,
    ) -> None:
        self.history = history
        self.tag = tag  # in every id this call makes
        self.create_response = create_response
        self.interrupt_response = interrupt_response
        self.warm_turn = warm_turn
        # None: speech over a reply cuts it at once.
        self.false_interruptions = false_interruptions
        # A turn's end is told to the client with its reply's first audio; speech before
        # that reopens the turn (False: told at once, and such speech is a new turn).
        self.reopen_unheard = reopen_unheard
        self.background = Background(history, prefills=prefills, summaries=summaries, block_size=block_size,
                                     reply_live=lambda: self.reply is not None or bool(self.stopping),
                                     writing=lambda: (self.reply is not None and not self.reply.written)
                                     or bool(self.stopping),
                                     turn_open=self._turn_open, log=log)
        self._answering = False  # a transcribed turn is appended and its reply about to start
        self._ids = itertools.count(1)
        self.turn_seq = 0
        self.open_item: str | None = None  # the caller's turn being spoken
        self.pending: _Turn | None = None  # decoded speculatively, not yet ended
        self.turns: dict[str, _Turn] = {}  # ended or committed, transcript not yet in
        self.held: _Turn | None = None  # ended, its end not yet told to the client (reopen_unheard)
        self.reply: Reply | None = None  # the one live reply
        self.stopping: dict[str, Reply] = {}  # cancelled, their ReplyEnded still due
        self.overlap: _Overlap | None = None  # speech over the paused reply, being judged
        # A turn whose speech cut a reply at its transcript: it follows the reply's end
        # in the history (by reply id; at most one).
        self._after_reply: dict[str, tuple[_Turn, str]] = {}
        self.closed = False

    def new_item_id(self) -> str:
        return f"item_{self.tag}_{next(self._ids)}"

    @property
    def replying(self) -> bool:
        """A reply is released to the caller and not finished."""
        return self.reply is not None and self.reply.released

    @property
    def audible(self) -> bool:
        """A released reply that the client was told of: its audio may be playing."""
        return self.reply is not None and self.reply.released and self.reply.shown

    # ------------------------------------------------------------------ dispatch
    def handle(self, event: ev.Event, now: float = 0.0) -> list[ev.Action]:
        """Decide what ``event`` calls for at time ``now`` (seconds, the call's clock)."""
        self.background.now = now
        actions = self._handle(event, now)
        # Whatever the event changed (a turn closed, a grace ran out), a compaction held
        # back for a window may start now.
        return actions + self.background.retry()

    def _turn_open(self) -> bool:
        """The caller speaks, or a turn of theirs ended and its reply is not written yet."""
        return (self.open_item is not None or self.pending is not None or bool(self.turns) or self._answering
                or (self.reply is not None and self.reply.turn is not None and not self.reply.written))

    def _handle(self, event: ev.Event, now: float) -> list[ev.Action]:  # noqa: C901 (one case per event)
        bg = self.background
        match event:
            case ev.SpeechStart():
                return self._speech_start(now)
            case ev.Quiet():
                # Decode now, unless a partial that saw the speech to its end is decoded
                # or decoding: it becomes the final (the ASR stream decides).
                if self.overlap is not None:
                    self.overlap.quiet_from = now  # it sounded until now
                return [*self._overlap_too_long(now), ev.RequestPartial()]
            case ev.Pause():
                return self._speculate()
            case ev.Resume():
                if self.overlap is not None:
                    self.overlap.quiet_from = None  # it sounds again
                return self._overlap_too_long(now) + self._drop_speculation()
            case ev.TurnEnd():
                return self._end_turn()
            case ev.Partial(text, confirmed, tentative):
                if self.open_item is None:
                    return []
                actions: list[ev.Action] = []
                if self.overlap is not None and self.overlap.item_id == self.open_item:
                    actions += self._overlap_too_long(now)
                    if self.overlap is not None:
                        fi = self.false_interruptions
                        assert fi is not None
                        if fi.is_backchannel(text):
                            return []  # still only a backchannel: the client sees nothing yet
                        actions += self._interrupt()
                actions.append(ev.EmitPartial(self.open_item, confirmed, tentative))
                if self.warm_turn and self.create_response:
                    # The caller's words so far: at the end of the turn its prompt
                    # prefills only what came after their last whole cache block.
                    actions += bg.warm_turn(text)
                return actions
            case ev.Transcribed(item_id, text):
                return self._transcribed(item_id, text)
            case ev.ReplyEnded():
                return self._reply_ended(event)
            case ev.ReplyShown(reply_id):
                if self.reply is None or self.reply.id != reply_id:
                    return []
                self.reply.shown = True
                return self._reveal()
            case ev.ReplyWritten(reply_id, audio_s):
                if self.reply is None or self.reply.id != reply_id or not self.reply.released:
                    return []
                self.reply.written = True
                return bg.reply_written(audio_s)
            case ev.Tick():
                return []  # the grace ran out: retried after every event
            case ev.ToolResults(_, options, tool_round):
                if self.reply is not None or self.closed:
                    return []
                return self._start_reply(gated=False, turn=None, options=options, tool_round=tool_round + 1)
            case ev.Commit(item_id):
                # A client's command takes the floor: the held turn is told first.
                actions = self._reveal()
                self.turn_seq += 1
                self.turns[item_id] = _Turn(item_id, self.turn_seq, committed=True)
                return [*actions, ev.CommitTurn(item_id)]
            case ev.Clear():
                return [*self._reveal(), ev.ResetInput(), *self._drop_speculation()]
            case ev.CreateReply(options):
                actions = self._reveal() + self._cancel("cancelled", report=True)
                return actions + self._start_reply(gated=False, turn=None, options=options)
            case ev.CancelReply(status, report):
                return self._reveal() + self._cancel(status, report=report)
            case ev.AddItem(role, text, item_id, call_id, tool_calls):
                actions = self._reveal()
                return actions + self._append(role, text, item_id, call_id=call_id, tool_calls=tool_calls)
            case ev.ContextChanged():
                return bg.warm()
            case ev.SettingsChanged(create_response, interrupt_response):
                self.create_response, self.interrupt_response = create_response, interrupt_response
                return bg.warm()
            case ev.PrefillProgress(pid, end):
                bg.prefill_progress(pid, end)
                return []
            case ev.PrefillDone(pid, ok):
                return bg.prefill_done(pid, ok)
            case ev.SummaryDone(sid, text):
                return bg.summary_done(sid, text)
            case ev.Started():
                bg.started = True
                return bg.warm()
            case ev.Closing():
                self.closed = bg.closed = True
                return []
        raise TypeError(f"not an event: {event!r}")

    # ------------------------------------------------------------------ turns
    def _speech_start(self, now: float) -> list[ev.Action]:
        reopened = self._reopen()
        if reopened:
            return reopened
        actions: list[ev.Action] = self._reveal()
        if self.overlap is not None:
            # Speech again while the last speech over the reply is still being judged:
            # the caller is taking the floor.
            actions += self._interrupt()
        fi = self.false_interruptions
        if self.reply is not None and self.interrupt_response and fi is not None and self.replying:
            # Not yet known to be a turn: pause the reply, tell the client nothing.
            self.turn_seq += 1
            self.open_item = self.new_item_id()
            self.overlap = _Overlap(self.open_item, self.reply.id, now - fi.speech_before_s)
            return [*actions, ev.PauseReply(self.reply.id), ev.OpenTurn(self.open_item, announce=False)]
        if self.reply is not None and self.interrupt_response:
            actions += self._cancel("interrupted", report=True)
        self.turn_seq += 1
        self.open_item = self.new_item_id()
        return [*actions, ev.OpenTurn(self.open_item)]

    def _overlap_too_long(self, now: float) -> list[ev.Action]:
        """Speech over the paused reply that has gone on this long is a turn, whatever
        its words (say, a long noise the recogniser makes nothing of)."""
        o, fi = self.overlap, self.false_interruptions
        if o is None or fi is None or o.item_id != self.open_item or o.length(now) <= fi.max_speech_s:
            return []
        return self._interrupt()

    def _interrupt(self) -> list[ev.Action]:
        """The speech over the paused reply is a turn: the client is told of it, and
        the reply is cut where it paused (a barge-in)."""
        o, self.overlap = self.overlap, None
        if o is None:
            return []
        # The reply it cut, then the speech, as a barge-in that cut at once is reported.
        actions: list[ev.Action] = []
        if self.reply is not None and self.reply.id == o.reply_id:
            actions += self._cancel("interrupted", report=True)
        return [*actions, ev.AnnounceTurn(o.item_id)]

    def _resume(self, turn: _Turn) -> list[ev.Action]:
        """The speech over the paused reply was no turn: the reply goes on."""
        o, self.overlap = self.overlap, None
        assert o is not None
        actions: list[ev.Action] = [ev.ForgetTurn(o.item_id)]
        if turn.reply is not None and self.reply is not None and turn.reply == self.reply.id:
            # The paused reply ended meanwhile and this one was prepared for the speech.
            actions += self._cancel("cancelled", report=False)
        if self.reply is not None and self.reply.id == o.reply_id:
            actions.append(ev.ResumeReply(o.reply_id))
        return actions

    def _speculate(self) -> list[ev.Action]:
        if self.open_item is None or not self.create_response:
            return []
        if self.replying:
            # Speech over a reply that it did not interrupt (interrupt_response off),
            # or that it paused and may yet resume: no reply of its own is prepared.
            return []
        actions = self._drop_speculation()  # never two of one turn
        turn = self.pending = _Turn(self.open_item, self.turn_seq)
        actions.append(ev.StartFinal(turn.item_id))
        actions += self._start_reply(gated=True, turn=turn)
        return actions

    def _drop_speculation(self) -> list[ev.Action]:
        turn, self.pending = self.pending, None
        if turn is None:
            return []
        actions: list[ev.Action] = [ev.CancelFinal(turn.item_id)]
        if turn.reply is not None and self.reply is not None and turn.reply == self.reply.id:
            actions += self._cancel("cancelled", report=False)
        return actions

    def _end_turn(self) -> list[ev.Action]:
        if self.open_item is None:
            return []
        actions: list[ev.Action] = []
        turn = self.pending
        if turn is None:
            turn = _Turn(self.open_item, self.turn_seq)
            actions.append(ev.StartFinal(turn.item_id))
        self.pending = None
        self.turns[turn.item_id] = turn
        # Held only where a reply of ours follows that speech may still withdraw (not a
        # turn spoken over a paused reply: the client hears of that one when it is one).
        hold = (self.reopen_unheard and self.create_response and self.interrupt_response
                and (self.overlap is None or self.overlap.item_id != turn.item_id))
        if hold:
            actions += self._reveal()  # never two held
            self.held = turn
        actions.append(ev.EndTurn(turn.item_id, held=hold))
        self.open_item = None
        return actions

    def _reveal(self) -> list[ev.Action]:
        """The held turn's end goes to the client now: its reply is heard, or none will be,
        or a client's command comes after it."""
        turn, self.held = self.held, None
        return [] if turn is None else [ev.RevealTurn(turn.item_id)]

    def _reopen(self) -> list[ev.Action]:
        """Speech after a held turn whose reply nobody heard yet: withdraw the reply unseen,
        and the turn goes on (its transcript, decoded or decoding, is dropped: the turn's
        final will cover all of its audio). Empty: the turn cannot reopen."""
        turn, r = self.held, self.reply
        if turn is None or self.open_item is not None or self.overlap is not None:
            return []
        if r is not None and (r.turn != turn.item_id or r.shown or r.tool_round):
            return []
        self.held = None
        actions = self._cancel("cancelled", report=False)  # unheard: nothing to report
        if self.turns.pop(turn.item_id, None) is not None:
            actions.append(ev.CancelFinal(turn.item_id))
        else:
            self.history.delete(turn.item_id)  # type: ignore[attr-defined]
        self.turn_seq += 1
        self.open_item = turn.item_id
        actions.append(ev.ReopenTurn(turn.item_id))
        return actions

    def _transcribed(self, item_id: str, text: str) -> list[ev.Action]:
        turn = self.turns.pop(item_id, None)
        if turn is None:
            return []
        text = text.strip()
        o = self.overlap
        if o is not None and o.item_id == item_id:
            assert self.false_interruptions is not None
            if self.false_interruptions.is_backchannel(text):
                return self._resume(turn)
            if self.reply is not None and self.reply.id == o.reply_id:
                # Cut; the history keeps what was heard of it first, then this turn: both
                # follow its ReplyEnded.
                self.overlap = None
                self._after_reply[o.reply_id] = (turn, text)
                return self._cancel("interrupted", report=True)
            return self._interrupt() + self._turn_transcribed(turn, text)
        return self._turn_transcribed(turn, text)

    def _turn_transcribed(self, turn: _Turn, text: str) -> list[ev.Action]:
        item_id = turn.item_id
        actions: list[ev.Action] = [ev.TurnTranscribed(item_id, text)]
        own = turn.reply is not None and self.reply is not None and turn.reply == self.reply.id
        if not text:  # a noise the VAD took for speech: no reply follows
            return actions + (self._cancel("cancelled", report=False) if own else []) + self._reveal()
        # A reply follows: the compaction this append may make due waits for its window.
        self._answering = own or (self.create_response and self.reply is None)
        try:
            actions += self._append("user", text, item_id)
        finally:
            self._answering = False
        if turn.seq != self.turn_seq:
            return actions  # the caller is already speaking again: no reply to this turn
        if own:
            assert self.reply is not None
            self.reply.released = True
            actions.append(ev.ReleaseReply(self.reply.id))
        elif self.create_response and self.reply is None:
            actions += self._start_reply(gated=False, turn=turn)
        return actions

    # ------------------------------------------------------------------ replies
    def _start_reply(self, *, gated: bool, turn: _Turn | None, options: Any = None, tool_round: int = 0) -> list[ev.Action]:
        actions: list[ev.Action] = []
        if self.reply is not None:
            actions += self._cancel("cancelled", report=False)  # one live reply
        rid = f"resp_{self.tag}_{next(self._ids)}"
        self.reply = Reply(rid, self.new_item_id(), turn.item_id if turn else None, not gated, tool_round)
        if turn is not None and gated:
            turn.reply = rid
        actions += self.background.reply_started()
        withdrawable = self.reopen_unheard and self.interrupt_response and turn is not None and not turn.committed
        actions.append(ev.StartReply(rid, self.reply.item_id, self.reply.turn, gated, options, tool_round, withdrawable))
        return actions

    def _cancel(self, status: str, *, report: bool) -> list[ev.Action]:
        r, self.reply = self.reply, None
        if r is None:
            return []
        self.stopping[r.id] = r
        # Only a reply the caller was told of is reported (and kept in the history).
        return [ev.StopReply(r.id, status, report and r.released)]

    def _reply_ended(self, e: ev.ReplyEnded) -> list[ev.Action]:
        r = self.reply if self.reply is not None and self.reply.id == e.reply_id else self.stopping.get(e.reply_id)
        if r is None:
            return []  # nothing of a reply after its end
        actions: list[ev.Action] = []
        kept = e.text is not None
        if kept:
            actions += self._reveal()  # ended before it was shown (it said nothing): its turn first
            # Appended while it still holds the LLM: no compaction starts beside it.
            actions += self._append("assistant", e.text or "", r.item_id, token_ids=e.token_ids)
            actions.append(ev.ReportReply(r.id, e.status))
        if self.reply is r:
            self.reply = None
        self.stopping.pop(r.id, None)
        actions += self.background.reply_ended(kept, e.computed if kept else None)
        after = self._after_reply.pop(r.id, None)
        if after is not None:  # the speech that cut it, a turn now
            actions += [ev.AnnounceTurn(after[0].item_id), *self._turn_transcribed(*after)]
        return actions

    # ------------------------------------------------------------------ history
    def _append(self, role: str, text: str, item_id: str, **kw: Any) -> list[ev.Action]:
        if kw.get("token_ids") is not None:
            kw["token_ids"] = list(kw["token_ids"])
        if kw.get("tool_calls") is not None:
            kw["tool_calls"] = list(kw["tool_calls"])
        kw = {k: v for k, v in kw.items() if v is not None}
        self.history.append(role, text, item_id, **kw)  # type: ignore[attr-defined]
        return self.background.trim()
