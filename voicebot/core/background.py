"""The conversation's budget and the call's background LLM work.

Background work is what the caller does not wait for: prefilling the conversation so
far into the prefix cache (so the next reply prefills only what is new), and
summarising the turns that leave the history. At most one prefill and one summary run
at once, never beside a live reply's start, and no prefill beside a trim's summary. A
summary starts only when no prefill runs: the prefill is what the next reply needs, and
on one background slot a summary's decode (seconds) would hold it back.

The budget has one path, the compaction: past ``compact_at`` of the budget the turns
the next trim would drop are summarised while the history still holds them; once the
summary is written the history without them is prefilled, and swapped in when that
prefill covers the history as it is then (what was appended meanwhile is prefilled
first; replies until then use the history as it was, still cached). The history may
still reach the budget first (replies come faster than a summary): a compaction whose
summary is written is then swapped in at once, and its prefill goes on from what it
had computed. The hard trim (drop now, summarise after) is the fallback when none is
written, or no prefix cache keeps a prefill: dropping turns at the front moves every
kept token, so the kept history is prefilled first, then the dropped turns are
summarised, and that summary (a new system message) is swapped in as a compaction is,
once the history with it is prefilled.

A compaction's summary also waits for a window in the conversation
(:mod:`voicebot.core.summary_window`): not while the caller's turn is open, nor in the
grace after a reply's audio ends; best while the caller listens to a written reply. At
the deadline (less room before the hard trim than one exchange) it goes at once.

Decisions only: the caller of :class:`Background` runs the actions it returns and
reports back with :meth:`prefill_progress`, :meth:`prefill_done` and
:meth:`summary_done`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from voicebot.core.events import (
    Action,
    CancelPrefill,
    CancelSummary,
    StartPrefill,
    StartSummary,
    WakeAt,
)
from voicebot.core.summary_window import SummaryWindow

# Dropped messages waiting for the summariser; beyond this the oldest are forgotten.
MAX_UNSUMMARISED = 200


class History(Protocol):
    """The conversation as the core needs it (voicebot/session/history.py)."""

    summary: str | None

    def history_ids(self) -> list[int]: ...
    def user_prefix_ids(self, words: str) -> list[int]: ...
    def over_budget(self) -> bool: ...
    def near_budget(self) -> bool: ...
    def room(self) -> int: ...
    def trim(self) -> list[Any]: ...
    def trim_plan(self) -> list[Any]: ...
    def compacted_ids(self, head: list[Any], summary: str | None) -> list[int] | None: ...
    def compact(self, head: list[Any], summary: str | None) -> bool: ...
    def set_summary(self, summary: str) -> None: ...


def common_prefix(a: list[int], b: list[int] | tuple[int, ...]) -> list[int]:
    n = 0
    for x, y in zip(a, b, strict=False):  # the shorter one ends it
        if x != y:
            break
        n += 1
    return a[:n]


@dataclass
class Compaction:
    """The oldest turns being folded into the summary ahead of the budget."""

    head: list[Any]  # the messages to drop, as they were (compared by identity); none: a trim's summary
    earlier: str | None  # the summary when it started: kept if writing the new one fails
    summary: str | None = None
    written: bool = False
    warmed: list[int] = field(default_factory=list)  # of the history after it, prefilled so far


@dataclass
class _Prefill:
    id: int
    ids: list[int]
    whole: int  # tokens of it the cache can hold: whole blocks
    compaction: Compaction | None


@dataclass
class _Summary:
    id: int
    compaction: Compaction | None  # None: a trim's dropped turns


class Background:
    def __init__(self, history: History, *, prefills: bool, summaries: bool, block_size: int | Callable[[], int],
                 reply_live: Callable[[], bool] = lambda: False,
                 writing: Callable[[], bool] | None = None,
                 turn_open: Callable[[], bool] = lambda: False,
                 log: logging.Logger | logging.LoggerAdapter[Any] | None = None) -> None:
        self.history = history
        self.prefills = prefills  # background prefills on, and a prefix cache keeps them
        self.summaries = summaries  # a background lane to write summaries on
        # The prefix cache holds whole blocks only (read when needed: an engine knows it
        # once started).
        self._block_size = block_size
        self.log = log or logging.getLogger(__name__)
        self.started = False
        self.closed = False
        self._reply_live = reply_live  # a live reply holds the LLM: no background work
        # A reply's LLM work is not done (a live reply may be written and still playing).
        self._writing = writing or reply_live
        self._turn_open = turn_open  # the caller speaks, or their turn's reply is not written yet
        self.window = SummaryWindow()
        self.now = 0.0  # the call's clock at the event being handled
        self.held = False  # a compaction due and held back by the window
        self._wake: float | None = None  # the last WakeAt asked for
        # Tokens the last exchanges added (a turn and its reply): the deadline's yardstick.
        self._exchanges: deque[int] = deque(maxlen=3)
        self._exchange_from: int | None = None
        self._reply_from: list[int] = []  # the history the live reply's prompt started with
        self.warmed: list[int] = []  # the history last prefilled, whole cache blocks
        self.prefill: _Prefill | None = None
        self.summary: _Summary | None = None
        self.compaction: Compaction | None = None
        self.unsummarised: list[Any] = []  # dropped from the history, not yet summarised
        self._serial = 0

    @property
    def block_size(self) -> int:
        return self._block_size() if callable(self._block_size) else self._block_size

    def _next(self) -> int:
        self._serial += 1
        return self._serial

    @property
    def holders(self) -> int:
        return (self.prefill is not None) + (self.summary is not None)

    # ------------------------------------------------------------------ prefills
    def warm(self, ids: list[int] | None = None) -> list[Action]:
        """Prefill the conversation so far while nobody waits on the LLM. ``ids``: a
        longer start of the next prompt than the history (the caller's words so far)."""
        if not self.prefills or not self.started or self.closed or self._reply_live():
            return []
        if self.summary is not None and self.summary.compaction is None:
            return []  # its summary rewrites the system message; it prefills after that
        # A compaction's summary leaves the place to prefills: until it lands, replies use
        # the history as it is, and a prefill of it keeps their prompts cached (one place
        # for both left replies to prefill 48 tokens instead of 25, test_warm_prefix).
        c = self.compaction
        if c is not None and c.written:
            # The history without the compacted turns first: the caller's words after it
            # are prefilled by the next partial, once it is the history.
            compacted = self.history.compacted_ids(c.head, c.summary)
            if compacted is None:  # a client deleted or rewrote one of its messages meanwhile
                self.compaction = None
                return self.trim()
            ids = compacted
        else:
            c = None
            if ids is None:
                ids = self.history.history_ids()
        whole = len(ids) // self.block_size * self.block_size
        if whole == 0 or ids[:whole] == self.warmed[:whole]:
            return self._apply(c) if c is not None else []
        actions: list[Action] = []
        if self.prefill is not None:
            if ids[:whole] == self.prefill.ids[:whole]:
                return []  # being prefilled already
            actions.append(CancelPrefill(self.prefill.id))  # superseded
        known = c.warmed if c is not None else self.warmed
        self.prefill = _Prefill(self._next(), ids, whole, c)
        actions.append(StartPrefill(self.prefill.id, tuple(ids), len(common_prefix(ids, known))))
        return actions

    def warm_turn(self, words: str) -> list[Action]:
        return self.warm(self.history.user_prefix_ids(words))

    def cancel_prefill(self) -> list[Action]:
        p, self.prefill = self.prefill, None
        return [CancelPrefill(p.id)] if p is not None else []

    def prefill_progress(self, pid: int, end: int) -> None:
        """A piece is in: a retry after a live turn starts there."""
        p = self.prefill
        if p is None or p.id != pid:
            return
        done = p.ids[: end // self.block_size * self.block_size]
        if p.compaction is not None:
            p.compaction.warmed = done
        else:
            self.warmed = done

    def prefill_done(self, pid: int, ok: bool) -> list[Action]:
        p = self.prefill
        if p is None or p.id != pid:
            return []
        self.prefill = None
        actions: list[Action] = []
        if ok:
            self.warmed = p.ids[: p.whole]
            c = p.compaction
            if c is not None:
                c.warmed = self.warmed
                if c is self.compaction and not self._reply_live():
                    # Swapped in once the history as it is now is prefilled: a turn appended
                    # while this ran is not in it, and the next reply would prefill it itself.
                    actions = self.warm()
        return actions + self._summarise_when_idle() + self._compact_when_idle()

    # ------------------------------------------------------------------ the budget
    def trim(self) -> list[Action]:
        """After the history grew: compact ahead of the budget, or trim past it."""
        h = self.history
        actions: list[Action] = []
        if self.prefills:
            if not h.over_budget():
                return self.start_compaction() if h.near_budget() else []
            # Over the budget before the compaction was ready (replies come faster than
            # a summary on this machine): trim now, its summary as well if written.
            c, self.compaction = self.compaction, None
            if self.summary is not None and self.summary.compaction is not None:
                actions.append(CancelSummary(self.summary.id))
                self.summary = None
            if c is not None and c.written and h.compact(c.head, c.summary):
                # Swapped in before its prefill was done: what that prefill computed is
                # cached, and the next prefill goes on from there.
                self.warmed = common_prefix(h.history_ids(), c.warmed)
                if not h.over_budget():
                    return actions + self.warm()
        dropped = h.trim()
        if not dropped:
            return actions
        if self.summaries:
            self.unsummarised.extend(dropped)
            if len(self.unsummarised) > MAX_UNSUMMARISED:  # the summariser is far behind
                del self.unsummarised[: len(self.unsummarised) - MAX_UNSUMMARISED]
        if self.summary is None:
            # Nothing of the kept history is cached: it is the start of the next reply's
            # prompt, so it is prefilled first (a prefill of the history before is of no use
            # now), and the dropped turns are summarised after it.
            actions += self.cancel_prefill()
            actions += self.warm()
            actions += self._summarise_when_idle()
        return actions

    def _summarise_when_idle(self) -> list[Action]:
        """A trim's dropped turns are summarised once no prefill runs or is due: the summary
        holds the background place, and no prefill starts beside it."""
        if not self.unsummarised or self.summary is not None:
            return []
        if self.prefills and (self.prefill is not None or self._reply_live()):
            return []  # after the prefill, or the live reply's end
        return self._summarise()

    def _summarise(self) -> list[Action]:
        dropped, self.unsummarised = self.unsummarised, []
        self.summary = _Summary(self._next(), None)
        return [StartSummary(self.summary.id, tuple(dropped), self.history.summary)]

    def _compact_when_idle(self) -> list[Action]:
        return self.start_compaction() if self.history.near_budget() else []

    def start_compaction(self) -> list[Action]:
        if not self.prefills:
            return []  # nothing would keep the compacted history's prefill: trims do it all
        if self.prefill is not None:
            # What the next reply needs first: on one background slot the summary's prompt
            # and its decode (seconds) held that prefill back. It starts when that is done.
            return []
        if self.compaction is not None or self.summary is not None or self.unsummarised:
            return []  # one at a time; a trim's summary rewrites the system message first
        if self._writing():
            # Its summary's prompt would be prefilled in the steps that carry the live
            # reply's tokens. The reply written (or its end) comes back here.
            return []
        head = self.history.trim_plan()
        if not head:
            return []
        if not self._window_open():
            return self._hold()
        self.held = False
        self.compaction = Compaction(head, self.history.summary)
        self.summary = _Summary(self._next(), self.compaction)
        return [StartSummary(self.summary.id, tuple(head), self.history.summary)]

    @property
    def exchange(self) -> int:
        return max(self._exchanges, default=0)

    def _window_open(self) -> bool:
        deadline = self.window.deadline(self.history.room(), self.exchange)
        return self.window.opens(self.now, turn_open=self._turn_open(), deadline=deadline)

    def _hold(self) -> list[Action]:
        self.held = True
        at = self.window.wake_at(self.now, turn_open=self._turn_open())
        if at is None or at == self._wake:
            return []
        self._wake = at
        return [WakeAt(at)]

    def retry(self) -> list[Action]:
        """After any event: a compaction the window held back starts once it opens."""
        if not self.held or self.closed:
            return []
        self.held = False
        return self._compact_when_idle()

    def summary_done(self, sid: int, text: str | None) -> list[Action]:
        s = self.summary
        if s is None or s.id != sid:
            return []
        self.summary = None
        c = s.compaction
        if c is not None:
            # A failed summary keeps the one before: its turns are dropped unsummarised.
            c.summary = c.earlier if text is None else text
            c.written = True
            return self.warm()
        if text is not None:
            if self.prefills and not self.unsummarised:
                # A new system message: nothing of the history after it would be cached.
                # Swapped in as a compaction (dropping nothing more) once it is prefilled;
                # replies until then use the kept history, prefilled already.
                self.compaction = Compaction([], self.history.summary, text, written=True)
            else:
                self.history.set_summary(text)
        # Dropped while it was written: folded into the next one, after the prefill.
        return self.warm() + self._summarise_when_idle()

    def _apply(self, c: Compaction) -> list[Action]:
        self.compaction = None
        if not self.history.compact(c.head, c.summary):
            self.log.info("history changed while it was compacted: compacting again")
        if self.history.over_budget():
            return self.trim()
        return self.warm() + self._compact_when_idle()  # the history's prefill first (if any is due)

    # ------------------------------------------------------------------ replies
    def reply_started(self) -> list[Action]:
        """The reply's own prompt starts with that prefix: a prefill still queued would
        only compete with it (one already in an engine step finishes that step)."""
        self._reply_from = self.history.history_ids()
        return self.cancel_prefill()

    def reply_written(self, audio_s: float) -> list[Action]:
        """The live reply's LLM work is done and ``audio_s`` of its audio are to play: the
        caller listens, the window for a compaction's summary."""
        self.window.reply_written(self.now, audio_s)
        if self.history.history_ids()[: len(self._reply_from)] != self._reply_from:
            # A swap under the reply: its prompt cached the history before it, so the
            # prefill after the reply is all of the history, and a summary started now
            # would hold that prefill back on the one background slot. It comes back
            # once that prefill is done.
            return []
        return self._compact_when_idle()

    def reply_ended(self, kept: bool, computed: tuple[int, ...] | None) -> list[Action]:
        """``kept``: the reply went into the history; ``computed``: what its request
        left in the prefix cache (its prompt and all but its last token)."""
        self.window.reply_ended(self.now)
        if kept:
            n = len(self.history.history_ids())
            if self._exchange_from is not None and n > self._exchange_from:  # not across a swap
                self._exchanges.append(n - self._exchange_from)
            self._exchange_from = n
        if computed is not None:
            # Prefill the history only where it has a whole block more than that, or more
            # than a prefill computed (a compaction swapped in at this reply's end).
            history = self.history.history_ids()
            self.warmed = max(common_prefix(history, computed), common_prefix(history, self.warmed), key=len)
        # A reply dropped unheard may have dropped a prefill; a trim's summary and a
        # compaction held back while this reply was live wait for it.
        actions = self.warm() + self._summarise_when_idle()
        return actions + (self._compact_when_idle() if kept else [])
