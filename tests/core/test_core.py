"""The call core alone: tables of events -> actions, and random event orders against
the invariants of a call. No asyncio, no engine: each test is microseconds."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from voicebot.config import DEFAULT_BACKCHANNEL_WORDS
from voicebot.core import CallCore
from voicebot.core import events as ev
from voicebot.core.backchannel import FalseInterruptions
from voicebot.core.summary_window import GRACE_S


@dataclass(frozen=True, eq=False)  # compared by identity, as the real history's
class Msg:
    role: str
    content: str
    item_id: str | None = None


def _ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 1000 for w in text.split()] + [0]


class FakeHistory:
    """Counts a token per word (and one per message), budget as the real one."""

    def __init__(self, budget: int = 10_000, reserved: int = 8) -> None:
        self.budget, self.reserved = budget, reserved
        self.summary: str | None = None
        self.messages: list[Msg] = []

    def _system(self, summary: str | None) -> list[int]:
        return [1] * 8 + (_ids(summary) if summary else [])

    def history_ids(self) -> list[int]:
        ids = self._system(self.summary)
        for m in self.messages:
            ids += _ids(m.content)
        return ids

    def user_prefix_ids(self, words: str) -> list[int]:
        return self.history_ids() + _ids(words)[:-1]

    def append(self, role: str, content: str, item_id: str | None = None, token_ids: object = None, **_: Any) -> None:
        if content.strip() or role == "tool":
            self.messages.append(Msg(role, content.strip(), item_id))

    def delete(self, item_id: str) -> bool:
        kept = [m for m in self.messages if m.item_id != item_id]
        found, self.messages = len(kept) < len(self.messages), kept
        return found

    def over_budget(self) -> bool:
        return len(self.history_ids()) + self.reserved > self.budget

    def near_budget(self) -> bool:
        return len(self.history_ids()) + self.reserved > self.budget * 0.8

    def room(self) -> int:
        return self.budget - self.reserved - len(self.history_ids())

    def trim_plan(self) -> list[Msg]:
        count, target = len(self.history_ids()), int(self.budget * 0.6) - self.reserved
        users = [i for i, m in enumerate(self.messages) if m.role == "user"]
        keep_from = users[-1] if users else len(self.messages) - 1
        n = 0
        while n < keep_from and count > target:
            count -= len(_ids(self.messages[n].content))
            n += 1
            while n < keep_from and self.messages[n].role in ("assistant", "tool"):
                count -= len(_ids(self.messages[n].content))
                n += 1
        return self.messages[:n]

    def trim(self) -> list[Msg]:
        if not self.over_budget():
            return []
        head = self.trim_plan()
        del self.messages[: len(head)]
        return head

    def _starts_with(self, head: list[Msg]) -> bool:
        return len(head) <= len(self.messages) and all(a is b for a, b in zip(head, self.messages, strict=False))

    def compacted_ids(self, head: list[Msg], summary: str | None) -> list[int] | None:
        if not self._starts_with(head):
            return None
        ids = self._system(summary)
        for m in self.messages[len(head):]:
            ids += _ids(m.content)
        return ids

    def compact(self, head: list[Msg], summary: str | None) -> bool:
        if not self._starts_with(head):
            return False
        del self.messages[: len(head)]
        self.set_summary(summary or "")
        return True

    def set_summary(self, summary: str) -> None:
        self.summary = summary.strip() or None


def core(**kw: Any) -> CallCore:
    history = kw.pop("history", None) or FakeHistory()
    c = CallCore(history, tag="t", **kw)
    c.handle(ev.Started())
    return c


def kinds(actions: list[ev.Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


# ------------------------------------------------------------------------- tables

def test_a_turn_with_a_speculation_released_at_its_end() -> None:
    c = core()
    assert kinds(c.handle(ev.SpeechStart())) == ["OpenTurn"]
    assert c.open_item == "item_t_1"
    assert kinds(c.handle(ev.Quiet())) == ["RequestPartial"]
    pause = c.handle(ev.Pause())
    assert kinds(pause) == ["StartFinal", "StartReply"]
    start = pause[1]
    assert isinstance(start, ev.StartReply) and start.gated and start.turn == "item_t_1"
    assert not c.replying, "a gated reply is not heard"
    assert kinds(c.handle(ev.TurnEnd())) == ["EndTurn"], "the speculative final is the turn's"
    done = c.handle(ev.Transcribed("item_t_1", " what time is it "))
    assert done[0] == ev.TurnTranscribed("item_t_1", "what time is it")
    assert done[-1] == ev.ReleaseReply(start.reply_id) and c.replying
    assert [m.content for m in c.history.messages] == ["what time is it"]  # type: ignore[attr-defined]


def test_speech_resumed_cancels_the_speculation_unreported() -> None:
    c = core()
    c.handle(ev.SpeechStart())
    start = c.handle(ev.Pause())[1]
    assert isinstance(start, ev.StartReply)
    assert c.handle(ev.Resume()) == [ev.CancelFinal("item_t_1"), ev.StopReply(start.reply_id, "cancelled", False)]
    assert kinds(c.handle(ev.ReplyEnded(start.reply_id, "cancelled"))) == []
    assert c.reply is None and c.history.messages == []  # type: ignore[attr-defined]
    assert kinds(c.handle(ev.TurnEnd())) == ["StartFinal", "EndTurn"], "a fresh final for the whole turn"


def test_a_turn_without_speculation_starts_its_reply_when_transcribed() -> None:
    c = core()
    c.handle(ev.SpeechStart())
    assert kinds(c.handle(ev.TurnEnd())) == ["StartFinal", "EndTurn"]
    actions = c.handle(ev.Transcribed("item_t_1", "hello"))
    assert kinds(actions) == ["TurnTranscribed", "StartReply"]
    assert c.replying


def test_noise_ends_its_speculation_and_starts_nothing() -> None:
    c = core()
    c.handle(ev.SpeechStart())
    start = c.handle(ev.Pause())[1]
    c.handle(ev.TurnEnd())
    assert isinstance(start, ev.StartReply)
    assert c.handle(ev.Transcribed("item_t_1", "  ")) == [
        ev.TurnTranscribed("item_t_1", ""), ev.StopReply(start.reply_id, "cancelled", False)]


def test_a_barge_in_keeps_what_was_heard() -> None:
    c = core()
    c.handle(ev.SpeechStart())
    c.handle(ev.TurnEnd())
    start = c.handle(ev.Transcribed("item_t_1", "tell me a story"))[-1]
    assert isinstance(start, ev.StartReply)
    barge = c.handle(ev.SpeechStart())
    assert barge == [ev.StopReply(start.reply_id, "interrupted", True), ev.OpenTurn("item_t_4")]
    ended = c.handle(ev.ReplyEnded(start.reply_id, "interrupted", "Once upon"))
    assert ended == [ev.ReportReply(start.reply_id, "interrupted")]
    assert [m.content for m in c.history.messages] == ["tell me a story", "Once upon"]  # type: ignore[attr-defined]
    assert c.handle(ev.ReplyEnded(start.reply_id, "completed", "Once upon a time")) == [], "nothing after its end"


def test_speech_over_a_reply_it_does_not_interrupt() -> None:
    c = core(interrupt_response=False)
    c.handle(ev.SpeechStart())
    c.handle(ev.TurnEnd())
    c.handle(ev.Transcribed("item_t_1", "hi"))
    assert kinds(c.handle(ev.SpeechStart())) == ["OpenTurn"]
    assert c.handle(ev.Pause()) == [], "no speculation over a reply that plays on"


def test_a_stale_turn_is_kept_but_not_answered() -> None:
    c = core()
    c.handle(ev.SpeechStart())
    c.handle(ev.TurnEnd())
    c.handle(ev.SpeechStart())  # the caller goes on before the transcript is in
    assert kinds(c.handle(ev.Transcribed("item_t_1", "wait"))) == ["TurnTranscribed"]
    assert c.reply is None and [m.content for m in c.history.messages] == ["wait"]  # type: ignore[attr-defined]


# A reply the caller has not heard a word of is withdrawn when they go on: the turn
# reopens (one utterance, one transcript, one user item) and the client hears of neither
# the turn's end nor the reply.

def _ended_at_a_pause() -> tuple[CallCore, ev.StartReply]:
    """A turn that paused (a reply prepared gated), then ended there."""
    c = core(reopen_unheard=True)
    c.handle(ev.SpeechStart())
    start = c.handle(ev.Pause())[1]
    assert isinstance(start, ev.StartReply) and start.withdrawable
    assert c.handle(ev.TurnEnd()) == [ev.EndTurn("item_t_1", held=True)], "its end not told until the reply is heard"
    return c, start


def _unheard() -> tuple[CallCore, ev.StartReply]:
    """A turn ended at a pause taken for its end; its reply released, no audio out yet."""
    c, start = _ended_at_a_pause()
    assert c.handle(ev.Transcribed("item_t_1", "I would like to book")) == [
        ev.TurnTranscribed("item_t_1", "I would like to book"), ev.ReleaseReply(start.reply_id)]
    return c, start


def test_speech_before_a_word_of_the_reply_is_heard_reopens_the_turn() -> None:
    c, start = _unheard()
    assert c.handle(ev.SpeechStart()) == [ev.StopReply(start.reply_id, "cancelled", False), ev.ReopenTurn("item_t_1")]
    assert c.open_item == "item_t_1" and c.history.messages == [], "the turn goes on: not yet in the history"  # type: ignore[attr-defined]
    assert c.handle(ev.ReplyEnded(start.reply_id, "cancelled")) == [], "dropped unheard, nothing reported"
    again = c.handle(ev.Pause())
    assert kinds(again) == ["StartFinal", "StartReply"] and again[0] == ev.StartFinal("item_t_1")
    second = again[1]
    assert isinstance(second, ev.StartReply) and second.turn == "item_t_1"
    assert c.handle(ev.TurnEnd()) == [ev.EndTurn("item_t_1", held=True)]
    c.handle(ev.Transcribed("item_t_1", "I would like to book a table for two"))
    assert c.handle(ev.ReplyShown(second.reply_id)) == [ev.RevealTurn("item_t_1")]
    assert [m.content for m in c.history.messages] == ["I would like to book a table for two"]  # type: ignore[attr-defined]
    barge = c.handle(ev.SpeechStart())
    assert barge == [ev.StopReply(second.reply_id, "interrupted", True), ev.OpenTurn("item_t_6")], \
        "a reply heard is barged in on as before"


def test_speech_before_the_transcript_reopens_the_turn_and_drops_its_decode() -> None:
    c, start = _ended_at_a_pause()
    assert c.handle(ev.SpeechStart()) == [
        ev.StopReply(start.reply_id, "cancelled", False), ev.CancelFinal("item_t_1"), ev.ReopenTurn("item_t_1")]
    assert c.handle(ev.Transcribed("item_t_1", "I would like")) == [], "the dropped decode's result is stale"
    assert kinds(c.handle(ev.TurnEnd())) == ["StartFinal", "EndTurn"], "one final for the whole turn"


def test_a_turn_without_speculation_reopens_before_its_reply_is_heard() -> None:
    c = core(reopen_unheard=True)
    c.handle(ev.SpeechStart())
    c.handle(ev.TurnEnd())
    start = c.handle(ev.Transcribed("item_t_1", "so"))[-1]
    assert isinstance(start, ev.StartReply) and not start.gated
    assert c.handle(ev.SpeechStart()) == [ev.StopReply(start.reply_id, "cancelled", False), ev.ReopenTurn("item_t_1")]


def test_the_held_end_of_a_turn_is_told_when_no_reply_will_be_heard() -> None:
    c, start = _ended_at_a_pause()
    assert c.handle(ev.Transcribed("item_t_1", " ")) == [
        ev.TurnTranscribed("item_t_1", ""), ev.StopReply(start.reply_id, "cancelled", False),
        ev.RevealTurn("item_t_1")], "a noise: no reply follows"
    assert kinds(c.handle(ev.SpeechStart())) == ["OpenTurn"]
    # A reply that ends before it was shown (it wrote nothing) still tells its turn first.
    c, start = _unheard()
    assert c.handle(ev.ReplyEnded(start.reply_id, "completed", "")) == [
        ev.RevealTurn("item_t_1"), ev.ReportReply(start.reply_id, "completed")]
    # A client's command takes the floor from the held turn: it is told first.
    c, start = _unheard()
    assert c.handle(ev.CreateReply())[:2] == [ev.RevealTurn("item_t_1"),
                                               ev.StopReply(start.reply_id, "cancelled", True)]


def test_a_turn_is_held_only_where_it_may_reopen() -> None:
    c = core()  # reopen_unheard off: the turn ends for the client at once, as before
    c.handle(ev.SpeechStart())
    assert c.handle(ev.TurnEnd())[-1] == ev.EndTurn("item_t_1", held=False)
    c = core(reopen_unheard=True, create_response=False)  # no reply of the server's to withdraw
    c.handle(ev.SpeechStart())
    assert c.handle(ev.TurnEnd())[-1] == ev.EndTurn("item_t_1", held=False)
    c = core(reopen_unheard=True)  # a turn the client committed: its reply is shown at once
    c.handle(ev.Commit("u1"))
    start = c.handle(ev.Transcribed("u1", "hello"))[-1]
    assert isinstance(start, ev.StartReply) and not start.withdrawable


def test_create_reply_replaces_the_live_one_and_tool_results_start_the_next_round() -> None:
    c = core()
    first = c.handle(ev.CreateReply())[-1]
    assert isinstance(first, ev.StartReply) and not first.gated
    again = c.handle(ev.CreateReply("opts"))
    assert again[0] == ev.StopReply(first.reply_id, "cancelled", True) and kinds(again)[-1] == "StartReply"
    second = again[-1]
    assert isinstance(second, ev.StartReply)
    assert c.handle(ev.ReplyEnded(first.reply_id, "cancelled", "")) == [ev.ReportReply(first.reply_id, "cancelled")]
    assert c.handle(ev.ReplyEnded(second.reply_id, "completed", "calling", computed=())) == [
        ev.ReportReply(second.reply_id, "completed")]
    tools = c.handle(ev.ToolResults(second.reply_id, "opts", 0))
    assert kinds(tools) == ["StartReply"]
    third = tools[-1]
    assert isinstance(third, ev.StartReply) and third.tool_round == 1 and third.options == "opts"


def test_the_call_is_prefilled_when_idle_and_not_beside_a_reply() -> None:
    c = CallCore(FakeHistory(), tag="t", prefills=True, block_size=4)
    assert c.handle(ev.ContextChanged()) == [], "nothing before the call runs"
    started = c.handle(ev.Started())
    assert kinds(started) == ["StartPrefill"]
    p = started[0]
    assert isinstance(p, ev.StartPrefill) and p.ids == (1,) * 8 and p.cached == 0
    assert c.handle(ev.ContextChanged()) == [], "the same ids are being prefilled"
    reply = c.handle(ev.CreateReply())
    assert reply[0] == ev.CancelPrefill(p.prefill), "a reply's own prompt has that prefix"
    assert c.background.prefill is None
    assert c.handle(ev.PrefillDone(p.prefill)) == [], "a cancelled prefill's end is ignored"


def test_no_prefill_when_none_is_kept() -> None:
    c = core(prefills=False)
    assert c.handle(ev.ContextChanged()) == [] and c.background.holders == 0


def test_compaction_ahead_of_the_budget_swaps_in_after_its_prefill() -> None:
    h = FakeHistory(budget=60)
    c, summary = _compacting(h)
    head = list(summary.messages)
    assert h.messages[: len(head)] == head, "the history keeps the turns while they are summarised"
    written = c.handle(ev.SummaryDone(summary.summary, "they talked about the weather"))
    assert kinds(written) == ["StartPrefill"]
    p = written[0]
    assert isinstance(p, ev.StartPrefill)
    assert h.messages[: len(head)] == head, "swapped in only once prefilled"
    c.handle(ev.PrefillDone(p.prefill))
    assert h.summary == "they talked about the weather" and h.messages[0] is not head[0]
    assert list(p.ids) == h.history_ids()


def test_over_the_budget_first_the_hard_trim_summarises_after() -> None:
    h = FakeHistory(budget=40)
    c = core(history=h, prefills=False, summaries=True)
    actions: list[ev.Action] = []
    n = 0
    while not actions:
        n += 1
        actions = c.handle(ev.AddItem("user", f"question number {n} about the weather today", f"u{n}"))
    assert kinds(actions) == ["StartSummary"] and not h.over_budget()
    s = actions[0]
    assert isinstance(s, ev.StartSummary)
    c.handle(ev.SummaryDone(s.summary, "weather"))
    assert h.summary == "weather"


def _exchanges_until_a_compaction(c: CallCore) -> ev.StartSummary:
    """Client-side exchanges, every prefill done at once, until a compaction's summary starts."""
    n = 0
    while True:
        n += 1
        actions = c.handle(ev.AddItem("user", f"question number {n} about the weather", f"u{n}"))
        actions += c.handle(ev.AddItem("assistant", f"answer number {n} is sunny", f"a{n}"))
        for a in list(actions):
            if isinstance(a, ev.StartPrefill):
                actions += c.handle(ev.PrefillDone(a.prefill))  # a summary waits for it
        summary = next((a for a in actions if isinstance(a, ev.StartSummary)), None)
        if summary is not None:
            return summary


def _compacting(h: FakeHistory) -> tuple[CallCore, ev.StartSummary]:
    c = core(history=h, prefills=True, summaries=True, block_size=4)
    c.handle(ev.PrefillDone(c.background.prefill.id))  # type: ignore[union-attr]
    return c, _exchanges_until_a_compaction(c)


def test_a_compaction_swaps_in_once_what_was_appended_during_its_prefill_is_prefilled_too() -> None:
    # The exchange appended while the compacted history was prefilled is not in what that
    # prefill computed: swapped in at once, the next reply prefilled it itself (a time to
    # first token seconds long on the CPU default, once per compaction).
    h = FakeHistory(budget=80)
    c, summary = _compacting(h)
    p = c.handle(ev.SummaryDone(summary.summary, "they talked about the weather"))[0]
    assert isinstance(p, ev.StartPrefill)
    assert c.handle(ev.AddItem("user", "and what about the weekend then", "late")) == []
    after = c.handle(ev.PrefillDone(p.prefill))
    assert h.summary is None, "swapped in with a tail nobody prefilled"
    assert kinds(after) == ["StartPrefill"]
    tail = after[0]
    assert isinstance(tail, ev.StartPrefill) and tail.cached == len(p.ids) // 4 * 4, "only what came after"
    assert c.handle(ev.PrefillDone(tail.prefill)) == [] and h.summary == "they talked about the weather"
    assert list(tail.ids) == h.history_ids(), "the history swapped in is the one prefilled"


def test_a_compaction_swapped_in_at_the_budget_prefills_only_what_its_own_prefill_had_not() -> None:
    # Replies come faster than a compaction: the reply that takes the history over the
    # budget swaps it in before its prefill was done. What that prefill had computed
    # is cached: the prefill after the reply goes on from there, not from the start
    # (each piece over cached blocks is still a request: seconds before the tail).
    h = FakeHistory(budget=80)
    c, summary = _compacting(h)
    p = c.handle(ev.SummaryDone(summary.summary, "they talked about the weather"))[0]
    assert isinstance(p, ev.StartPrefill)
    done = len(p.ids) // 4 * 4
    c.handle(ev.PrefillProgress(p.prefill, done))
    start = c.handle(ev.CreateReply())
    assert start[0] == ev.CancelPrefill(p.prefill)
    reply = start[-1]
    assert isinstance(reply, ev.StartReply)
    prompt = tuple(h.history_ids())
    text = "it will be sunny and warm all week long with a light breeze from the west and no rain"
    ended = c.handle(ev.ReplyEnded(reply.reply_id, "completed", text, None, prompt))
    assert h.summary == "they talked about the weather" and not h.over_budget(), "swapped in at the budget"
    warm = [a for a in ended if isinstance(a, ev.StartPrefill)]
    assert warm and list(warm[0].ids) == h.history_ids()
    assert warm[0].cached == done, f"{warm[0].cached} of {done} prefilled tokens known cached"


def test_a_compactions_summary_waits_for_the_prefill_the_next_reply_needs() -> None:
    # On one background slot a summary (its prompt, then a decode of seconds on the CPU)
    # held back the prefill queued beside it: after a compaction swapped in, the turn
    # appended during its prefill was still not prefilled when the caller's next turn
    # ended, 7 s later (the next compaction's summary had started at the swap).
    h = FakeHistory(budget=80)
    c = core(history=h, prefills=True, summaries=True, block_size=4)
    c.handle(ev.PrefillDone(c.background.prefill.id))  # type: ignore[union-attr]
    n = 0
    while len(h.history_ids()) + h.reserved + 31 <= 64:  # a reply of 30 words takes it past 80 %
        n += 1
        for a in c.handle(ev.AddItem("user", f"question {n}", f"u{n}")) + c.handle(ev.AddItem("assistant", "yes", f"a{n}")):
            if isinstance(a, ev.StartPrefill):
                c.handle(ev.PrefillDone(a.prefill))
    assert not h.near_budget()
    start = c.handle(ev.CreateReply())[-1]
    assert isinstance(start, ev.StartReply)
    ended = c.handle(ev.ReplyEnded(start.reply_id, "completed", " ".join(["sunny"] * 30), None, tuple(h.history_ids())))
    assert h.near_budget() and not h.over_budget() and kinds(ended) == ["ReportReply", "StartPrefill"], "the prefill first"
    p = ended[-1]
    assert isinstance(p, ev.StartPrefill)
    assert kinds(c.handle(ev.PrefillDone(p.prefill))) == ["WakeAt"], "then the compaction, once the caller did not answer"
    assert kinds(c.handle(ev.Tick(), GRACE_S)) == ["StartSummary"]


def test_a_hard_trim_prefills_the_kept_history_first_and_swaps_its_summary_in_once_prefilled() -> None:
    # Over the budget with no compaction ready: the oldest turns are dropped at once, which
    # moves every kept token out of the cache. The kept history is what the next reply's
    # prompt starts with: it is prefilled first, then the dropped turns are summarised, and
    # the summary (a new system message) is swapped in only once the history with it is
    # prefilled in turn. Before, the summary ran first and blocked prefills while it was
    # written, so the next reply prefilled the whole kept history itself, and the one after
    # the summary landed did it again.
    h = FakeHistory(budget=80)
    c, summary = _compacting(h)
    head = list(summary.messages)
    trimmed = c.handle(ev.AddItem("user", " ".join(["and"] + ["then"] * 14 + ["the weekend"]), "long"))
    assert kinds(trimmed) == ["CancelSummary", "StartPrefill"], "the kept history first"
    p = trimmed[-1]
    assert isinstance(p, ev.StartPrefill) and list(p.ids) == h.history_ids() and not h.over_budget()
    after = c.handle(ev.PrefillDone(p.prefill))
    assert kinds(after) == ["StartSummary"]
    s = after[0]
    assert isinstance(s, ev.StartSummary) and list(s.messages[: len(head)]) == head
    written = c.handle(ev.SummaryDone(s.summary, "weather"))
    assert h.summary is None, "swapped in only once prefilled"
    assert kinds(written) == ["StartPrefill"]
    p2 = written[0]
    assert isinstance(p2, ev.StartPrefill)
    c.handle(ev.PrefillDone(p2.prefill))
    assert h.summary == "weather" and list(p2.ids) == h.history_ids()


def test_a_hard_trim_at_a_replys_end_prefills_after_the_reply_then_summarises() -> None:
    h = FakeHistory(budget=80)
    c, _ = _compacting(h)
    start = c.handle(ev.CreateReply())[-1]
    assert isinstance(start, ev.StartReply)
    text = " ".join(["sunny"] * 20)
    ended = c.handle(ev.ReplyEnded(start.reply_id, "completed", text, None, tuple(h.history_ids())))
    assert kinds(ended) == ["CancelSummary", "ReportReply", "StartPrefill"], "the kept history first"
    p = ended[-1]
    assert isinstance(p, ev.StartPrefill) and list(p.ids) == h.history_ids()
    assert kinds(c.handle(ev.PrefillDone(p.prefill))) == ["StartSummary"]


# ------------------------------------------- when a compaction's summary may start
# A summary's prompt is prefilled in engine steps that nothing preempts: one that starts
# as the caller's turn ends delays the live reply by a step or more. It starts while the
# caller listens to a written reply, or after the grace that follows a reply's end.

class VoiceCall:
    """Voice exchanges against the core at a clock the test moves: a turn spoken for 2 s,
    its reply written 2 s after its transcript with ``audio_s`` left to play, every
    prefill done at once. ``by`` records which event started each summary."""

    def __init__(self, h: FakeHistory, *, speculate: bool) -> None:
        self.c = core(history=h, prefills=True, summaries=True, block_size=4)
        self.speculate = speculate
        self.now = 0.0
        self.by: list[str] = []
        self.summaries: list[ev.StartSummary] = []
        self.wakes: list[float] = []
        self.feed(ev.PrefillDone(self.c.background.prefill.id))  # type: ignore[union-attr]

    def feed(self, event: ev.Event, after: float = 0.0) -> list[ev.Action]:
        self.now += after
        actions = self.c.handle(event, self.now)
        for a in list(actions):
            if isinstance(a, ev.StartPrefill):
                actions += self.feed(ev.PrefillDone(a.prefill))
            elif isinstance(a, ev.StartSummary):
                self.by.append(type(event).__name__)
                self.summaries.append(a)
            elif isinstance(a, ev.WakeAt):
                self.wakes.append(a.at)
        return actions

    def turn(self, words: str) -> str:
        item = next(a for a in self.feed(ev.SpeechStart(), 1.0) if isinstance(a, ev.OpenTurn)).item_id
        if self.speculate:
            self.feed(ev.Pause(), 2.0)
            self.feed(ev.TurnEnd(), 0.4)
        else:
            self.feed(ev.TurnEnd(), 2.4)
        started = [a for a in self.feed(ev.Transcribed(item, words), 0.3) if isinstance(a, ev.StartReply)]
        assert self.c.reply is not None and self.c.reply.released
        return started[0].reply_id if started else self.c.reply.id

    def exchange(self, n: int, audio_s: float = 4.0) -> None:
        rid = self.turn(f"question number {n} about the weather")
        self.feed(ev.ReplyShown(rid), 0.5)
        self.feed(ev.ReplyWritten(rid, audio_s), 1.5)
        self.feed(ev.ReplyEnded(rid, "completed", f"answer number {n} is sunny", None, None), audio_s)


def test_a_compactions_summary_starts_while_the_caller_listens() -> None:
    for speculate in (False, True):
        call = VoiceCall(FakeHistory(budget=150), speculate=speculate)
        n = 0
        while not call.summaries:
            n += 1
            call.exchange(n)
        assert call.by == ["ReplyWritten"], f"started at {call.by} (speculate={speculate})"
        assert not call.c.history.over_budget()  # type: ignore[attr-defined]


def _filled(call: VoiceCall, ids: int) -> None:
    """Client-side messages (no exchange measured: no deadline) to ``ids`` or just short."""
    h = call.c.history
    assert isinstance(h, FakeHistory)
    n = 0
    while len(h.history_ids()) + 4 <= ids:
        n += 1
        call.feed(ev.AddItem("user", "q", f"fu{n}"))
        call.feed(ev.AddItem("assistant", "a", f"fa{n}"))


def test_a_compaction_due_at_a_replys_end_waits_out_the_callers_answer() -> None:
    h = FakeHistory(budget=150)  # a compaction past 112 ids
    call = VoiceCall(h, speculate=True)
    _filled(call, 100)
    rid = call.turn("question about the weather")
    call.feed(ev.ReplyWritten(rid, 4.0), 2.0)
    assert not h.near_budget() and not call.summaries
    ended = call.feed(ev.ReplyEnded(rid, "completed", " ".join(["sunny"] * 12), None, None), 4.0)
    assert h.near_budget() and not call.summaries, "not as the caller may answer"
    wake = [a for a in ended if isinstance(a, ev.WakeAt)]
    assert wake and wake[0].at == call.now + 1.5
    # They answer within the grace: held through their turn, started as they listen.
    rid = call.turn("and tomorrow")
    assert not call.summaries
    call.feed(ev.Tick(), 0.0)
    assert not call.summaries, "the caller's turn is open"
    call.feed(ev.ReplyWritten(rid, 4.0), 2.0)
    assert call.by == ["ReplyWritten"]


def test_a_compaction_held_for_the_grace_starts_when_the_caller_does_not_answer() -> None:
    h = FakeHistory(budget=150)
    call = VoiceCall(h, speculate=False)
    _filled(call, 100)
    rid = call.turn("question about the weather")
    assert call.feed(ev.ReplyWritten(rid, 0.5), 2.0) == [], "too little audio left to start under"
    call.feed(ev.ReplyEnded(rid, "completed", " ".join(["sunny"] * 12), None, None), 0.5)
    assert h.near_budget() and not call.summaries and call.wakes == [call.now + 1.5]
    assert call.feed(ev.Tick(), 1.4) == []
    assert kinds(call.feed(ev.Tick(), 0.1)) == ["StartSummary"]


def test_at_the_deadline_a_compaction_goes_while_the_caller_speaks() -> None:
    # Replies too short to leave a window: at less room before the hard trim than one
    # exchange, waiting could let the next one hit the trim.
    h = FakeHistory(budget=100)
    call = VoiceCall(h, speculate=False)
    n = 0
    while not call.summaries:
        n += 1
        rid = call.turn(f"question number {n} about the weather")
        assert h.room() >= call.c.background.exchange or call.summaries, "the deadline was not kept"
        call.feed(ev.ReplyEnded(rid, "completed", f"answer number {n} is sunny", None, None), 2.0)
    assert call.by in (["Transcribed"], ["ReplyEnded"]) and not h.over_budget()
    assert h.room() < call.c.background.exchange


# -------------------------------------------------------------- random event orders

class Shell:
    """Answers the core as the session does: a stopped reply ends at once (what was
    heard: its first word), finals and background work when the test says. A turn's
    transcript comes once the turn has ended or been committed, as the listener feeds it
    (``Listener._complete_turn``), never while a speculative final's turn is still open."""

    def __init__(self, c: CallCore) -> None:
        self.c = c
        self.live: dict[str, ev.StartReply] = {}
        self.heard: dict[str, str] = {}
        self.done: set[str] = set()
        self.finals: list[str] = []
        self.prefills: list[int] = []
        self.summaries: list[int] = []
        self.hidden: set[str] = set()  # turns opened over a paused reply, not yet announced
        self.forgotten: set[str] = set()
        self.held: set[str] = set()  # ended turns the client has not been told of yet
        self.shown: set[str] = set()  # replies the client was told of
        self.now = 0.0
        self.ended_at = -1e9  # the last reply's end

    def feed(self, event: ev.Event) -> None:
        if isinstance(event, ev.ReplyEnded):
            self.ended_at = self.now
        self.run(self.c.handle(event, self.now))

    def summary_started(self) -> None:
        """A compaction's summary starts while the caller listens to a written reply, or
        with no turn of theirs open, past the grace after a reply's end; else only at
        the deadline."""
        c, h = self.c, self.c.history
        bg = c.background
        assert bg.summary is not None
        if bg.summary.compaction is None:
            return  # a hard trim's: after the kept history's prefill
        assert c.reply is None or c.reply.written, "not beside a reply being written"
        if h.room() < bg.exchange:  # type: ignore[attr-defined]
            return  # the deadline
        assert not c._turn_open(), "not while the caller's turn is open"
        listening = c.reply is not None and c.reply.written
        assert listening or self.now >= self.ended_at + GRACE_S, "not as the caller may answer"

    def settle(self) -> None:
        """Every turn ended and answered, every reply and background job done, time let
        run: what was due has happened (nothing starves)."""
        c = self.c
        for _ in range(40):
            if c.open_item is not None:
                self.feed(ev.TurnEnd())
            while self.finals:
                self.feed(ev.Transcribed(self.finals.pop(0), "some words"))
            if c.reply is not None or c.overlap is not None:
                self.feed(ev.CancelReply())
                continue
            if self.prefills:
                self.feed(ev.PrefillDone(self.prefills.pop(0)))
            elif self.summaries:
                self.feed(ev.SummaryDone(self.summaries.pop(0), "a summary"))
            else:
                self.now += GRACE_S
                self.feed(ev.Tick())
                if not self.prefills and not self.summaries and c.reply is None and c.open_item is None:
                    break

    def run(self, actions: list[ev.Action]) -> None:
        for a in actions:
            rid = getattr(a, "reply_id", None)
            assert rid is None or rid not in self.done, f"{a} after the reply's end"
            match a:
                case ev.StartReply():
                    self.live[a.reply_id] = a
                    assert sum(1 for r in self.live if r not in self.done) <= 2  # one stopping, one live
                case ev.StopReply(rid, status, report):
                    text = f"word{len(self.done)}" if report else None
                    if report:
                        self.heard[rid] = text  # type: ignore[assignment]
                    self.feed(ev.ReplyEnded(rid, status, text))
                    self.done.add(rid)
                case ev.ReportReply(rid):
                    self.done.add(rid)
                case ev.OpenTurn(item, announce):
                    if not announce:
                        self.hidden.add(item)
                case ev.AnnounceTurn(item):
                    assert item in self.hidden
                    self.hidden.discard(item)
                case ev.ForgetTurn(item):
                    assert item in self.hidden
                    self.hidden.discard(item)
                    self.forgotten.add(item)
                case ev.EmitPartial(item) | ev.TurnTranscribed(item):
                    assert item not in self.hidden and item not in self.forgotten, "the client sees no hidden turn"
                case ev.PauseReply(rid) | ev.ResumeReply(rid):
                    assert self.c.reply is not None and self.c.reply.id == rid, "only the live reply pauses"
                    assert self.c.reply.released, "only a reply the caller hears"
                case ev.EndTurn(item, held):
                    if held:
                        self.held.add(item)
                    assert len(self.held) <= 1, "one turn held at a time"
                    self.finals.append(item)
                case ev.RevealTurn(item):
                    assert item in self.held
                    self.held.discard(item)
                case ev.ReopenTurn(item):
                    assert item in self.held
                    self.held.discard(item)
                    assert not any(self.live[r].turn == item for r in self.shown if r not in self.done), \
                        "never a reply the client was told of"
                case ev.CommitTurn(item):
                    self.finals.append(item)
                case ev.StartPrefill(pid):
                    self.prefills.append(pid)
                case ev.StartSummary(sid):
                    self.summaries.append(sid)
                    self.summary_started()
            bg = self.c.background
            assert bg.summary is None or bg.prefill is None or bg.summary.compaction is not None, \
                "no prefill beside a trim's summary"
        assert self.c.reply is None or self.c.reply.id not in self.done
        assert not self.c.stopping, "every stopped reply ended"


words = st.sampled_from(["yes", "what is the weather like in Paris today", "tell me more about it please"])
events = st.one_of(
    st.sampled_from(["speech", "quiet", "pause", "resume", "end", "clear", "create", "cancel", "complete",
                     "fail", "final", "final_empty", "prefill", "summary", "summary_fail", "commit", "shown",
                     "written", "written_short", "wait"]),
    st.tuples(st.just("text"), words),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(events, max_size=60), st.booleans(), st.integers(min_value=40, max_value=200), st.booleans(),
       st.booleans())
def test_random_calls_keep_the_invariants(script: list[Any], prefills: bool, budget: int, fi: bool,
                                          reopen: bool) -> None:
    h = FakeHistory(budget=budget)
    c = CallCore(h, tag="t", prefills=prefills, summaries=True, block_size=4, warm_turn=True, reopen_unheard=reopen,
                 false_interruptions=FalseInterruptions.of(DEFAULT_BACKCHANNEL_WORDS) if fi else None)
    shell = Shell(c)
    shell.feed(ev.Started())
    for step in script:
        r = c.reply
        if step == "speech":
            shell.feed(ev.SpeechStart())
        elif step == "quiet":
            shell.feed(ev.Quiet())
        elif step == "pause":
            shell.feed(ev.Pause())
        elif step == "resume":
            shell.feed(ev.Resume())
        elif step == "end":
            shell.feed(ev.TurnEnd())
        elif step == "clear":
            shell.feed(ev.Clear())
        elif step == "commit":
            shell.feed(ev.Commit(c.new_item_id()))
        elif step == "create":
            shell.feed(ev.CreateReply())
        elif step == "shown" and r is not None and r.released:
            shell.shown.add(r.id)
            shell.feed(ev.ReplyShown(r.id))
        elif step == "cancel":
            shell.feed(ev.CancelReply())
        elif step in ("written", "written_short") and r is not None and r.released and not r.written:
            shell.feed(ev.ReplyWritten(r.id, 4.0 if step == "written" else 0.5))
        elif step == "wait":
            shell.now += 1.0
            shell.feed(ev.Tick())
        elif step in ("complete", "fail") and r is not None and r.released:
            before = list(h.messages)
            text = "the whole reply as it was generated" if step == "complete" else "cut"
            shell.feed(ev.ReplyEnded(r.id, "completed" if step == "complete" else "failed", text))
            shell.done.add(r.id)
            assert [m.content for m in h.messages if m not in before] in ([text], []), "kept as generated"
            assert not h.over_budget() or len(h.messages) <= 1, "within the budget after each reply"
        elif step in ("final", "final_empty") and shell.finals:
            item = shell.finals.pop(0)
            shell.feed(ev.Transcribed(item, "" if step == "final_empty" else "some words"))
        elif step == "prefill" and shell.prefills:
            shell.feed(ev.PrefillDone(shell.prefills.pop(0)))
        elif step in ("summary", "summary_fail") and shell.summaries:
            shell.feed(ev.SummaryDone(shell.summaries.pop(0), None if step == "summary_fail" else "a summary"))
        elif isinstance(step, tuple):
            shell.feed(ev.Partial(step[1]))
            shell.feed(ev.AddItem("user", step[1], c.new_item_id()))
        if r is not None and r.id in shell.heard:
            # Cut (a barge-in): the history holds what was heard of the reply, not what it wrote.
            kept = [m for m in h.messages if m.item_id == r.item_id]
            assert [m.content for m in kept] in ([shell.heard[r.id]], []), "only what was heard"
        assert c.background.holders <= 2 and (c.background.prefill is None or c.reply is None), \
            "no prefill beside a live reply"
        shell.now += 0.2
    shell.settle()
    bg = c.background
    assert not bg.held, "a compaction held back for a window that never came"
    if prefills and h.trim_plan() and bg.compaction is None and bg.summary is None and not bg.unsummarised:
        assert not h.near_budget() or h.over_budget(), "a compaction due and never started"


def test_a_swap_forced_under_a_live_reply_has_its_prefill_before_the_next_summary() -> None:
    # The reply's prompt was the history before the swap: nothing of the swapped-in history
    # is cached. A summary started as the caller listened took the one background slot, and
    # the prefill after the reply waited behind its decode (a next reply 2.6 s late).
    h = FakeHistory(budget=80)
    c, summary = _compacting(h)
    assert isinstance(c.handle(ev.SummaryDone(summary.summary, "they talked about the weather"))[0], ev.StartPrefill)
    reply = c.handle(ev.CreateReply())[-1]
    assert isinstance(reply, ev.StartReply)
    n = 0
    while h.summary is None:  # client-side items while the reply is live: the budget forces the swap
        n += 1
        c.handle(ev.AddItem("user", "and what about the weekend then please tell me", f"x{n}"))
    assert h.near_budget(), "the next compaction is due"
    assert kinds(c.handle(ev.ReplyWritten(reply.reply_id, 4.0), 1.0)) == [], "the swapped-in history's prefill first"
    ended = c.handle(ev.ReplyEnded(reply.reply_id, "completed", "sunny", None, None), 5.0)
    p = [a for a in ended if isinstance(a, ev.StartPrefill)]
    assert p and list(p[0].ids) == h.history_ids(), kinds(ended)
    assert "StartSummary" not in kinds(ended)
    assert "StartSummary" not in kinds(c.handle(ev.PrefillDone(p[0].prefill), 5.1)), "not as the caller may answer"
    assert kinds(c.handle(ev.Tick(), 5.0 + GRACE_S)) == ["StartSummary"], "then, as they did not"
