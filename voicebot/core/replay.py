"""A call's core input as JSON lines, and its replay.

The session writes each event it feeds the core (``session.record``): a first line
with the core's settings, then ``{"t": seconds, "event": name, ...fields}``. Replaying
the lines through a fresh core reproduces its decisions: the same events in the same
order give the same actions. A client's per-reply options are not recorded (a replay
uses the call's own), and the history is a stand-in that counts words, so budget
decisions (compactions, trims) follow the words, not the model's tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from typing import Any

from voicebot.core import events as ev
from voicebot.core.backchannel import FalseInterruptions
from voicebot.core.call import CallCore

_EVENTS: dict[str, type] = {
    cls.__name__: cls
    for cls in (ev.Started, ev.Closing, ev.SpeechStart, ev.Quiet, ev.Pause, ev.Resume, ev.TurnEnd, ev.Partial,
                ev.Transcribed, ev.ReplyEnded, ev.ReplyShown, ev.ReplyWritten, ev.ToolResults, ev.Commit, ev.Clear, ev.CreateReply,
                ev.CancelReply, ev.AddItem, ev.ContextChanged, ev.SettingsChanged, ev.PrefillProgress, ev.PrefillDone,
                ev.SummaryDone, ev.Tick)
}
# The decisions a replay shows (the rest is bookkeeping: partials, finals, prefills).
SHOWN = (ev.OpenTurn, ev.AnnounceTurn, ev.ForgetTurn, ev.EndTurn, ev.RevealTurn, ev.ReopenTurn, ev.CommitTurn,
         ev.StartReply, ev.ReleaseReply, ev.PauseReply, ev.ResumeReply, ev.StopReply, ev.ReportReply, ev.StartSummary)


def header(core: CallCore, budget_tokens: int) -> str:
    bg = core.background
    return json.dumps({"call": {
        "tag": core.tag, "create_response": core.create_response, "interrupt_response": core.interrupt_response,
        "warm_turn": core.warm_turn, "reopen_unheard": core.reopen_unheard, "prefills": bg.prefills,
        "summaries": bg.summaries, "budget": budget_tokens,
        "false_interruptions": fi.as_dict() if (fi := core.false_interruptions) is not None else None,
    }})


def line(event: ev.Event, now: float) -> str:
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}  # type: ignore[arg-type]
    if "options" in fields:
        fields["options"] = None  # a client's objects: not recorded
    return json.dumps({"t": round(now, 4), "event": type(event).__name__, **fields})


def parse(text: str) -> tuple[float, ev.Event]:
    d = json.loads(text)
    cls = _EVENTS[d.pop("event")]
    now = d.pop("t")
    for k, v in d.items():
        if isinstance(v, list):
            d[k] = tuple(v)
    return now, cls(**d)


class WordHistory:
    """A stand-in history for replays: a token per word, the real one's budget rules."""

    def __init__(self, budget: int, reserved: int = 64) -> None:
        self.budget, self.reserved = budget, min(reserved, budget // 2)
        self.summary: str | None = None
        self.messages: list[tuple[str, str, str | None]] = []

    def _ids(self, text: str) -> list[int]:
        return [hash(w) % 50_000 for w in text.split()] + [0]

    def history_ids(self) -> list[int]:
        ids = self._ids(self.summary or "")
        for m in self.messages:
            ids += self._ids(m[1])
        return ids

    def user_prefix_ids(self, words: str) -> list[int]:
        return self.history_ids() + self._ids(words)[:-1]

    def append(self, role: str, content: str, item_id: str | None = None, *_: Any, **__: Any) -> None:
        if content.strip() or role == "tool":
            self.messages.append((role, content.strip(), item_id))

    def delete(self, item_id: str) -> bool:
        kept = [m for m in self.messages if m[2] != item_id]
        found, self.messages = len(kept) < len(self.messages), kept
        return found

    def over_budget(self) -> bool:
        return len(self.history_ids()) + self.reserved > self.budget

    def near_budget(self) -> bool:
        return len(self.history_ids()) + self.reserved > self.budget * 0.8

    def room(self) -> int:
        return self.budget - self.reserved - len(self.history_ids())

    def trim_plan(self) -> list[Any]:
        count, target = len(self.history_ids()), int(self.budget * 0.6) - self.reserved
        users = [i for i, m in enumerate(self.messages) if m[0] == "user"]
        keep_from = users[-1] if users else len(self.messages) - 1
        n = 0
        while n < keep_from and count > target:
            count -= len(self._ids(self.messages[n][1]))
            n += 1
            # As the real history: the kept part never starts with a reply or a tool result.
            while n < keep_from and self.messages[n][0] in ("assistant", "tool"):
                count -= len(self._ids(self.messages[n][1]))
                n += 1
        return self.messages[:n]

    def _starts_with(self, head: list[Any]) -> bool:
        # By identity, as the real history: a message replaced since is another one.
        return len(head) <= len(self.messages) and all(
            a is b for a, b in zip(head, self.messages, strict=False)
        )

    def trim(self) -> list[Any]:
        if not self.over_budget():
            return []
        head = self.trim_plan()
        del self.messages[: len(head)]
        return head

    def compacted_ids(self, head: list[Any], summary: str | None) -> list[int] | None:
        if not self._starts_with(head):
            return None
        ids = self._ids(summary or "")
        for m in self.messages[len(head):]:
            ids += self._ids(m[1])
        return ids

    def compact(self, head: list[Any], summary: str | None) -> bool:
        if not self._starts_with(head):
            return False
        del self.messages[: len(head)]
        self.set_summary(summary or "")
        return True

    def set_summary(self, summary: str) -> None:
        self.summary = summary.strip() or None


def replay(lines: Iterable[str]) -> Iterator[tuple[float, ev.Action]]:
    """Every action the core decides for the recorded events, with its time."""
    it = iter(lines)
    settings = json.loads(next(it))["call"]
    budget = settings.pop("budget")
    fi = settings.pop("false_interruptions", None)
    if fi is not None:
        settings["false_interruptions"] = FalseInterruptions(**{**fi, "words": frozenset(fi["words"])})
    core = CallCore(WordHistory(budget), **settings)
    for text in it:
        if text.strip():
            now, event = parse(text)
            for action in core.handle(event, now):
                yield now, action


def describe(action: ev.Action) -> str:
    fields = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(action).items() if k not in ("options", "messages"))
    return f"{type(action).__name__}({fields})"
