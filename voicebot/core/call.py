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
- the one live reply: started, released, cut by a barge-in (the history keeps what
  was heard), its tool rounds;
- the conversation's budget and background LLM work (:mod:`voicebot.core.background`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from voicebot.core import events as ev
from voicebot.core.background import Background, History


@dataclass
class Reply:
    id: str
    item_id: str
    turn: str | None
    released: bool
    tool_round: int = 0


@dataclass
class _Turn:
    item_id: str
    seq: int
    reply: str | None = None  # the reply prepared for it speculatively


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
        log: logging.Logger | logging.LoggerAdapter[Any] | None = None,
    ) -> None:
        self.history = history
        self.tag = tag  # in every id this call makes
        self.create_response = create_response
        self.interrupt_response = interrupt_response
        self.warm_turn = warm_turn
        self.background = Background(history, prefills=prefills, summaries=summaries, block_size=block_size,
                                     reply_live=lambda: self.reply is not None or bool(self.stopping), log=log)
        self._ids = itertools.count(1)
        self.turn_seq = 0
        self.open_item: str | None = None  # the caller's turn being spoken
        self.pending: _Turn | None = None  # decoded speculatively, not yet ended
        self.turns: dict[str, _Turn] = {}  # ended or committed, transcript not yet in
        self.reply: Reply | None = None  # the one live reply
        self.stopping: dict[str, Reply] = {}  # cancelled, their ReplyEnded still due
        self.closed = False

    def new_item_id(self) -> str:
        return f"item_{self.tag}_{next(self._ids)}"

    @property
    def replying(self) -> bool:
        """A reply is released to the caller and not finished."""
        return self.reply is not None and self.reply.released

    # ------------------------------------------------------------------ dispatch
    def handle(self, event: ev.Event, now: float = 0.0) -> list[ev.Action]:  # noqa: C901 (one case per event)
        """Decide what ``event`` calls for at time ``now`` (seconds, the call's clock)."""
        bg = self.background
        match event:
            case ev.SpeechStart():
                return self._speech_start()
            case ev.Quiet():
                # Decode now, unless a partial that saw the speech to its end is decoded
                # or decoding: it becomes the final (the ASR stream decides).
                return [ev.RequestPartial()]
            case ev.Pause():
                return self._speculate()
            case ev.Resume():
                return self._drop_speculation()
            case ev.TurnEnd():
                return self._end_turn()
            case ev.Partial(text, confirmed, tentative):
                if self.open_item is None:
                    return []
                actions: list[ev.Action] = [ev.EmitPartial(self.open_item, confirmed, tentative)]
                if self.warm_turn and self.create_response:
                    # The caller's words so far: at the end of the turn its prompt
                    # prefills only what came after their last whole cache block.
                    actions += bg.warm_turn(text)
                return actions
            case ev.Transcribed(item_id, text):
                return self._transcribed(item_id, text)
            case ev.ReplyEnded():
                return self._reply_ended(event)
            case ev.ToolResults(_, options, tool_round):
                if self.reply is not None or self.closed:
                    return []
                return self._start_reply(gated=False, turn=None, options=options, tool_round=tool_round + 1)
            case ev.Commit(item_id):
                self.turn_seq += 1
                self.turns[item_id] = _Turn(item_id, self.turn_seq)
                return [ev.CommitTurn(item_id)]
            case ev.Clear():
                return [ev.ResetInput(), *self._drop_speculation()]
            case ev.CreateReply(options):
                actions = self._cancel("cancelled", report=True)
                return actions + self._start_reply(gated=False, turn=None, options=options)
            case ev.CancelReply(status, report):
                return self._cancel(status, report=report)
            case ev.AddItem(role, text, item_id, call_id, tool_calls):
                return self._append(role, text, item_id, call_id=call_id, tool_calls=tool_calls)
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
    def _speech_start(self) -> list[ev.Action]:
        actions: list[ev.Action] = []
        if self.reply is not None and self.interrupt_response:
            actions += self._cancel("interrupted", report=True)
        self.turn_seq += 1
        self.open_item = self.new_item_id()
        return [*actions, ev.OpenTurn(self.open_item)]

    def _speculate(self) -> list[ev.Action]:
        if self.open_item is None or not self.create_response:
            return []
        if self.replying:
            # Speech over a reply that it did not interrupt (interrupt_response off):
            # that reply plays on; the turn is transcribed as usual.
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
        actions.append(ev.EndTurn(turn.item_id))
        self.open_item = None
        return actions

    def _transcribed(self, item_id: str, text: str) -> list[ev.Action]:
        turn = self.turns.pop(item_id, None)
        if turn is None:
            return []
        text = text.strip()
        actions: list[ev.Action] = [ev.TurnTranscribed(item_id, text)]
        own = turn.reply is not None and self.reply is not None and turn.reply == self.reply.id
        if not text:  # a noise the VAD took for speech
            return actions + (self._cancel("cancelled", report=False) if own else [])
        actions += self._append("user", text, item_id)
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
        actions.append(ev.StartReply(rid, self.reply.item_id, self.reply.turn, gated, options, tool_round))
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
            # Appended while it still holds the LLM: no compaction starts beside it.
            actions += self._append("assistant", e.text or "", r.item_id, token_ids=e.token_ids)
            actions.append(ev.ReportReply(r.id, e.status))
        if self.reply is r:
            self.reply = None
        self.stopping.pop(r.id, None)
        return actions + self.background.reply_ended(kept, e.computed if kept else None)

    # ------------------------------------------------------------------ history
    def _append(self, role: str, text: str, item_id: str, **kw: Any) -> list[ev.Action]:
        if kw.get("token_ids") is not None:
            kw["token_ids"] = list(kw["token_ids"])
        if kw.get("tool_calls") is not None:
            kw["tool_calls"] = list(kw["tool_calls"])
        kw = {k: v for k, v in kw.items() if v is not None}
        self.history.append(role, text, item_id, **kw)  # type: ignore[attr-defined]
        return self.background.trim()
