"""False interruptions in the call core: speech over a reply pauses it, a backchannel or
a noise resumes it unseen, words or length make it a barge-in. Tables of events ->
actions; no asyncio, no engine."""

from __future__ import annotations

from typing import Any

import pytest

from voicebot.config import DEFAULT_BACKCHANNEL_WORDS
from voicebot.core import CallCore
from voicebot.core import events as ev
from voicebot.core.backchannel import FalseInterruptions

FI = FalseInterruptions.of(DEFAULT_BACKCHANNEL_WORDS, max_words=3, max_speech_s=1.5, speech_before_s=0.2)


class History:
    def __init__(self) -> None:
        self.messages: list[tuple[str, str, str]] = []

    def append(self, role: str, content: str, item_id: str, **_: Any) -> None:
        if content.strip():
            self.messages.append((role, content.strip(), item_id))

    def history_ids(self) -> list[int]:
        return [1] * len(self.messages)

    def user_prefix_ids(self, words: str) -> list[int]:
        return [1]

    def over_budget(self) -> bool:
        return False

    def near_budget(self) -> bool:
        return False

    def room(self) -> int:
        return 10_000

    def trim_plan(self) -> list[Any]:
        return []

    def trim(self) -> list[Any]:
        return []

    def compacted_ids(self, head: list[Any], summary: str | None) -> list[int] | None:
        return None

    def compact(self, head: list[Any], summary: str | None) -> bool:
        return False

    def set_summary(self, summary: str) -> None:
        pass


def kinds(actions: list[ev.Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def replying_core(**kw: Any) -> tuple[CallCore, str]:
    """A call whose reply to "tell me a story" is being heard, at t = 10 s."""
    c = CallCore(History(), tag="t", false_interruptions=kw.pop("fi", FI), **kw)
    c.handle(ev.Started())
    c.handle(ev.SpeechStart(), 1.0)
    c.handle(ev.TurnEnd(), 2.0)
    start = c.handle(ev.Transcribed("item_t_1", "tell me a story"), 2.2)[-1]
    assert isinstance(start, ev.StartReply) and c.replying
    return c, start.reply_id


def roles(c: CallCore) -> list[tuple[str, str]]:
    return [(m[0], m[1]) for m in c.history.messages]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("text", "backchannel"), [
    ("Mm-hmm.", True), ("mm hmm", True), ("Okay.", True), ("Okay, yeah.", True), ("Uh-huh, right.", True),
    ("I see.", True), ("Thank you.", True), ("", True), ("  ...  ", True),
    ("Wait.", False), ("No.", False), ("Okay, so what about tomorrow?", False), ("yes yes yes yes", False),
    ("I", False), ("see", False),
    # Hums as whisper-base wrote a spoken "Mm-hmm." in different takes.
    ("M-M-M", True), ("Mmm.", True), ("Hmmm?", True), ("mhmm", True), ("Hmm-mm.", True), ("Mm, okay.", True),
    ("Mom.", False), ("Uh-uh.", False), ("hm hm hm hm", False),
])
def test_what_is_only_a_backchannel(text: str, backchannel: bool) -> None:
    assert FI.is_backchannel(text) is backchannel


def test_hums_are_only_backchannels_while_asked() -> None:
    words_only = FalseInterruptions.of(DEFAULT_BACKCHANNEL_WORDS, hums=False)
    assert not words_only.is_backchannel("M-M-M") and words_only.is_backchannel("Mm-hmm.")


def test_a_backchannel_over_the_reply_pauses_it_then_resumes_it_unseen() -> None:
    c, rid = replying_core()
    assert c.handle(ev.SpeechStart(), 10.0) == [ev.PauseReply(rid), ev.OpenTurn("item_t_4", announce=False)]
    assert c.replying, "paused, not cut"
    assert c.handle(ev.Partial("Mm-hmm."), 10.3) == [], "nothing on the wire while it is only a backchannel"
    assert kinds(c.handle(ev.Quiet(), 10.4)) == ["RequestPartial"]
    assert c.handle(ev.Pause(), 10.6) == [], "no reply of its own"
    assert kinds(c.handle(ev.TurnEnd(), 10.9)) == ["StartFinal", "EndTurn"]
    assert c.handle(ev.Transcribed("item_t_4", "Mm-hmm."), 11.0) == [ev.ForgetTurn("item_t_4"), ev.ResumeReply(rid)]
    assert c.reply is not None and c.reply.id == rid and c.overlap is None
    assert roles(c) == [("user", "tell me a story")], "a backchannel is no turn of the conversation"
    assert c.handle(ev.ReplyEnded(rid, "completed", "Once upon a time."), 14.0) == [ev.ReportReply(rid, "completed")]


def test_a_noise_over_the_reply_resumes_it() -> None:
    c, rid = replying_core()
    c.handle(ev.SpeechStart(), 10.0)
    c.handle(ev.TurnEnd(), 10.6)
    assert c.handle(ev.Transcribed("item_t_4", ""), 10.7) == [ev.ForgetTurn("item_t_4"), ev.ResumeReply(rid)]


def test_a_word_in_a_partial_makes_it_a_barge_in_at_once() -> None:
    c, rid = replying_core()
    c.handle(ev.SpeechStart(), 10.0)
    assert c.handle(ev.Partial("Okay"), 10.2) == []
    cut = c.handle(ev.Partial("Okay, wait", "Okay,", "wait"), 10.4)
    assert cut == [ev.StopReply(rid, "interrupted", True), ev.AnnounceTurn("item_t_4"),
                   ev.EmitPartial("item_t_4", "Okay,", "wait")]
    assert c.handle(ev.ReplyEnded(rid, "interrupted", "Once upon"), 10.4) == [ev.ReportReply(rid, "interrupted")]
    c.handle(ev.TurnEnd(), 11.0)
    done = c.handle(ev.Transcribed("item_t_4", "Okay, wait, a short one."), 11.1)
    assert kinds(done) == ["TurnTranscribed", "StartReply"], "then a turn like any other"
    assert roles(c) == [("user", "tell me a story"), ("assistant", "Once upon"), ("user", "Okay, wait, a short one.")]


def test_words_only_in_the_final_cut_the_reply_before_the_turn_is_in_the_history() -> None:
    c, rid = replying_core()
    c.handle(ev.SpeechStart(), 10.0)
    c.handle(ev.TurnEnd(), 10.6)
    cut = c.handle(ev.Transcribed("item_t_4", "Stop."), 10.7)
    assert cut == [ev.StopReply(rid, "interrupted", True)], "the speech is told of after the cut reply"
    ended = c.handle(ev.ReplyEnded(rid, "interrupted", "Once upon"), 10.7)
    assert kinds(ended) == ["ReportReply", "AnnounceTurn", "TurnTranscribed", "StartReply"]
    assert ended[1:3] == [ev.AnnounceTurn("item_t_4"), ev.TurnTranscribed("item_t_4", "Stop.")]
    assert roles(c) == [("user", "tell me a story"), ("assistant", "Once upon"), ("user", "Stop.")]


def test_speech_that_goes_on_too_long_is_a_barge_in_whatever_its_words() -> None:
    c, rid = replying_core()
    c.handle(ev.SpeechStart(), 10.0)  # speech since 9.8 (the detector's barge-in threshold)
    assert c.handle(ev.Partial(""), 11.0) == [], "1.2 s of speech with no words yet: still judged"
    assert kinds(c.handle(ev.Quiet(), 11.2)) == ["RequestPartial"] and c.overlap is not None
    assert c.handle(ev.Partial(""), 11.4) == [], "it stopped at 1.4 s: a late partial does not lengthen it"
    assert c.handle(ev.Pause(), 11.5) == []
    assert c.handle(ev.Resume(), 11.7)[:2] == [ev.StopReply(rid, "interrupted", True), ev.AnnounceTurn("item_t_4")]
    c2, rid2 = replying_core()
    c2.handle(ev.SpeechStart(), 10.0)
    assert c2.handle(ev.Quiet(), 11.4) == [ev.StopReply(rid2, "interrupted", True), ev.AnnounceTurn("item_t_4"),
                                           ev.RequestPartial()]


def test_a_short_backchannel_whose_words_come_late_still_resumes_the_reply() -> None:
    # A loaded machine decodes the partial of a 0.5 s "Okay." 2 s after it began: the
    # speech did not last 2 s, so it is still judged by its words.
    c, rid = replying_core()
    c.handle(ev.SpeechStart(), 10.0)
    assert kinds(c.handle(ev.Quiet(), 10.5)) == ["RequestPartial"]
    assert c.handle(ev.Partial("Okay"), 12.0) == []
    c.handle(ev.TurnEnd(), 12.1)
    assert c.handle(ev.Transcribed("item_t_4", "Okay."), 12.3) == [ev.ForgetTurn("item_t_4"), ev.ResumeReply(rid)]


def test_more_speech_while_the_last_is_judged_takes_the_floor() -> None:
    c, rid = replying_core()
    c.handle(ev.SpeechStart(), 10.0)
    c.handle(ev.TurnEnd(), 10.6)
    again = c.handle(ev.SpeechStart(), 10.8)
    assert again == [ev.StopReply(rid, "interrupted", True), ev.AnnounceTurn("item_t_4"), ev.OpenTurn("item_t_5")], \
        "the first speech becomes a turn, and cuts the reply"
    c.handle(ev.ReplyEnded(rid, "interrupted", "Once upon"), 10.8)
    assert kinds(c.handle(ev.Transcribed("item_t_4", "Mm-hmm."), 10.9)) == ["TurnTranscribed"], \
        "told of, so transcribed; not answered: the caller went on"


def test_speech_before_the_reply_is_released_cuts_it_as_before() -> None:
    c = CallCore(History(), tag="t", false_interruptions=FI)
    c.handle(ev.Started())
    c.handle(ev.SpeechStart(), 1.0)
    start = c.handle(ev.Pause(), 1.5)[1]
    assert isinstance(start, ev.StartReply) and start.gated
    c.handle(ev.TurnEnd(), 2.0)
    assert c.handle(ev.SpeechStart(), 2.1) == [ev.StopReply(start.reply_id, "interrupted", False),
                                              ev.OpenTurn("item_t_4")]


def test_a_reply_that_ended_while_paused_is_not_resumed() -> None:
    c, rid = replying_core()
    c.handle(ev.SpeechStart(), 10.0)
    assert c.handle(ev.ReplyEnded(rid, "completed", "Once upon a time."), 10.2) == [ev.ReportReply(rid, "completed")]
    c.handle(ev.TurnEnd(), 10.6)
    assert c.handle(ev.Transcribed("item_t_4", "okay"), 10.7) == [ev.ForgetTurn("item_t_4")]
    assert c.reply is None and roles(c)[-1] == ("assistant", "Once upon a time.")


def test_without_false_interruptions_speech_cuts_the_reply_at_once() -> None:
    c, rid = replying_core(fi=None)
    assert c.handle(ev.SpeechStart(), 10.0) == [ev.StopReply(rid, "interrupted", True), ev.OpenTurn("item_t_4")]
