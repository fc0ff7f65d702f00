"""The assistant side of the Realtime wire: one reply from ``response.created`` to
``response.done``, its transcript deltas and its audio in the client's output format.

A reply's output items: its spoken message (output_index 0) and, after it, any
``function_call`` items the model made (``response.function_call_arguments.delta`` /
``.done``, ``response.output_item.added`` / ``.done``, and in ``response.done``'s
output). Once a session has tools (``lazy_message``), the message item is announced
only when the reply says something: a reply that only calls a tool has no empty
message item, as with OpenAI.

Synchronous, no I/O; owned by :class:`~voicebot.transports.realtime_session.RealtimeTranslator`,
which shares its :class:`Wire` (naming family, formats) with it.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from voicebot.audio import ReplyResampler, float_to_pcm16
from voicebot.session import events as se
from voicebot.tools.spec import ToolCall
from voicebot.transports import realtime_events as rt
from voicebot.transports.realtime_tools import function_call_item
from voicebot.wire import g711

_MEMO = 8  # finished replies remembered: their late events are dropped, truncate is checked

_STATUS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "completed": ("completed", None),
    "cancelled": ("cancelled", {"type": "cancelled", "reason": "client_cancelled"}),
    "interrupted": ("cancelled", {"type": "cancelled", "reason": "turn_detected"}),
    "failed": ("failed", {"type": "failed", "error": {"type": "server_error", "code": "engine_error",
                                                       "message": "the reply could not be generated"}}),
}


@dataclass
class Wire:
    """Per-connection wire choices, shared by the translator and the replies."""

    fam: rt.Family = rt.GA
    in_fmt: rt.AudioFormat = "audio/pcm"
    out_fmt: rt.AudioFormat = "audio/pcm"
    text_only: bool = False


@dataclass
class Call:
    """A function call item of the reply being streamed."""

    item_id: str
    call_id: str
    name: str
    output_index: int
    arguments: list[str] = field(default_factory=list)
    done: dict[str, Any] | None = None  # its final item body

    def where(self, rid: str) -> dict[str, Any]:
        return {"response_id": rid, "item_id": self.item_id, "output_index": self.output_index,
                "call_id": self.call_id}


@dataclass
class Reply:
    id: str
    item_id: str
    deltas: list[str] = field(default_factory=list)
    audio_ms: float = 0.0
    resampler: ReplyResampler | None = None
    opened: bool = False  # its message item was announced
    calls: dict[str, Call] = field(default_factory=dict)  # call_id -> call, in order

    @property
    def where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}


class Replies:
    def __init__(self, wire: Wire, view: Callable[[], rt.SessionView],
                 link: Callable[[str], str | None]) -> None:
        self.wire = wire
        self._view = view
        self._link = link  # records a new item as the latest; returns the previous one
        self.current: Reply | None = None
        self.lazy_message = False  # set once the session has tools (see the module doc)
        self._done: OrderedDict[str, None] = OrderedDict()
        self._sent_ms: OrderedDict[str, float] = OrderedDict()

    def sent_ms(self, item_id: str) -> float | None:
        """Audio sent so far for a recent reply item (None: not a recent reply)."""
        cur = self.current
        return cur.audio_ms if cur is not None and cur.item_id == item_id else self._sent_ms.get(item_id)

    def start(self, rid: str, item_id: str) -> list[dict[str, Any]]:
        """The events that open a reply, once (also for a reply that ends before it began)."""
        if (self.current is not None and self.current.id == rid) or rid in self._done:
            return []
        w = self.wire
        self.current = reply = Reply(rid, item_id)
        out = [{"type": "response.created", "response": rt.response_object(w.fam, self._view(), rid, "in_progress")}]
        return out if self.lazy_message else out + self._open(reply)

    def _open(self, reply: Reply) -> list[dict[str, Any]]:
        """Announce the reply's message item, once."""
        if reply.opened:
            return []
        reply.opened = True
        w = self.wire
        prev = self._link(reply.item_id)
        body = rt.reply_item(w.fam, reply.item_id, None, "in_progress", w.text_only)
        part = {"type": "text", "text": ""} if w.text_only else {"type": "audio", "transcript": ""}
        return [{"type": "response.output_item.added", "response_id": reply.id, "output_index": 0, "item": body},
                {"type": w.fam.item_added, "previous_item_id": prev, "item": body},
                {"type": "response.content_part.added", **reply.where, "part": part}]

    # ------------------------------------------------------------ function calls
    def call_started(self, ev: se.ToolCallStarted) -> list[dict[str, Any]]:
        if ev.response_id in self._done:
            return []
        out = self.start(ev.response_id, ev.item_id)
        reply = self.current
        assert reply is not None
        call = reply.calls[ev.call_id] = Call(ev.item_id, ev.call_id, ev.name, int(reply.opened) + len(reply.calls))
        body = function_call_item(ev.item_id, ev.call_id, ev.name, "", "in_progress")
        prev = self._link(ev.item_id)
        return [*out, {"type": "response.output_item.added", "response_id": reply.id,
                       "output_index": call.output_index, "item": body},
                {"type": self.wire.fam.item_added, "previous_item_id": prev, "item": body}]

    def call_arguments(self, ev: se.ToolCallArgumentsDelta) -> list[dict[str, Any]]:
        reply = self.current
        call = reply.calls.get(ev.call_id) if reply is not None and reply.id == ev.response_id else None
        if reply is None or call is None:
            return []
        call.arguments.append(ev.delta)
        return [{"type": "response.function_call_arguments.delta", **call.where(reply.id), "delta": ev.delta}]

    def call_done(self, ev: se.ToolCallDone) -> list[dict[str, Any]]:
        c = ev.call
        if ev.response_id in self._done:
            return []
        out = [] if self.current is not None and c.call_id in self.current.calls else self.call_started(
            se.ToolCallStarted(ev.response_id, c.item_id, c.call_id, c.name))
        reply = self.current
        assert reply is not None
        call = reply.calls[c.call_id]
        # The parser's canonical JSON; what the deltas said if the call never completed.
        arguments = c.arguments if c.valid else "".join(call.arguments)
        call.done = body = function_call_item(c.item_id, c.call_id, c.name, arguments,
                                              "completed" if c.valid else "incomplete")
        out += [{"type": "response.function_call_arguments.done", **call.where(reply.id), "name": c.name,
                 "arguments": arguments},
                {"type": "response.output_item.done", "response_id": reply.id, "output_index": call.output_index,
                 "item": body}]
        if self.wire.fam.item_done:
            out.append({"type": self.wire.fam.item_done, "previous_item_id": None, "item": body})
        return out

    def text(self, ev: se.ResponseTextDelta) -> list[dict[str, Any]]:
        if ev.response_id in self._done:
            return []
        out = self.start(ev.response_id, ev.item_id)
        assert self.current is not None
        out += self._open(self.current)
        self.current.deltas.append(ev.text)
        name = self.wire.fam.text_delta if self.wire.text_only else self.wire.fam.transcript_delta
        return [*out, {"type": name, **self.current.where, "delta": ev.text}]

    def audio(self, ev: se.ResponseAudio) -> list[dict[str, Any]]:
        if ev.response_id in self._done or self.wire.text_only:
            return []
        out = self.start(ev.response_id, ev.item_id)
        assert self.current is not None
        return out + self._open(self.current) + self._encode(ev.audio, ev.sample_rate)

    def _encode(self, audio: np.ndarray | None, rate: int) -> list[dict[str, Any]]:
        reply, fmt = self.current, self.wire.out_fmt
        assert reply is not None
        out_rate = rt.format_rate(fmt)
        if reply.resampler is None:  # the wire's rate when the reply's audio began
            reply.resampler = ReplyResampler(out_rate)
        samples = reply.resampler.flush() if audio is None else reply.resampler.process(reply.id, audio, rate)
        if samples.size == 0:
            return []
        reply.audio_ms += 1000.0 * samples.size / out_rate
        data = float_to_pcm16(samples)
        if fmt != "audio/pcm":
            data = g711.encode(fmt, data)
        return [{"type": self.wire.fam.audio_delta, **reply.where, "delta": base64.b64encode(data).decode()}]

    def finish(self, done: se.ResponseDone) -> list[dict[str, Any]]:
        if done.response_id in self._done:
            return []
        out = self.start(done.response_id, done.item_id)
        reply, w = self.current, self.wire
        assert reply is not None
        if done.status == "completed" and reply.resampler is not None and not w.text_only:
            out += self._encode(None, 0)  # the resampler's tail
        status, details = _STATUS[done.status]
        if done.status == "completed" and done.finish_reason == "length":
            status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        transcript = "".join(reply.deltas)  # exactly what the deltas said
        output: list[dict[str, Any]] = []
        if reply.opened or not reply.calls:
            output.append(self._close_message(reply, transcript, status, out))
        for call in reply.calls.values():  # a call cut short is closed as incomplete
            if call.done is None:
                out += self.call_done(se.ToolCallDone(reply.id, ToolCall(
                    call.call_id, call.item_id, call.name, "".join(call.arguments), valid=False)))
            assert call.done is not None
            output.append(call.done)
        usage = {"total_tokens": done.input_tokens + done.output_tokens, "input_tokens": done.input_tokens,
                 "output_tokens": done.output_tokens,
                 "input_token_details": {"cached_tokens": done.cached_tokens, "text_tokens": done.input_tokens}}
        out.append({"type": "response.done", "response": rt.response_object(
            w.fam, self._view(), reply.id, status, details=details, output=output, usage=usage)})
        self.current = None
        self._done[reply.id] = None
        self._sent_ms[reply.item_id] = reply.audio_ms
        for memo in (self._done, self._sent_ms):
            while len(memo) > _MEMO:
                memo.popitem(last=False)
        return out

    def _close_message(self, reply: Reply, transcript: str, status: str, out: list[dict[str, Any]]) -> dict[str, Any]:
        """The message item's closing events (appended to ``out``); returns its body."""
        w = self.wire
        out += self._open(reply)
        body = rt.reply_item(w.fam, reply.item_id, transcript,
                             "completed" if status == "completed" else "incomplete", w.text_only)
        if w.text_only:
            out += [{"type": w.fam.text_done, **reply.where, "text": transcript},
                    {"type": "response.content_part.done", **reply.where, "part": {"type": "text", "text": transcript}}]
        else:
            out += [{"type": w.fam.audio_done, **reply.where},
                    {"type": w.fam.transcript_done, **reply.where, "transcript": transcript},
                    {"type": "response.content_part.done", **reply.where,
                     "part": {"type": "audio", "transcript": transcript}}]
        out.append({"type": "response.output_item.done", "response_id": reply.id, "output_index": 0, "item": body})
        if w.fam.item_done:
            out.append({"type": w.fam.item_done, "previous_item_id": None, "item": body})
        return body
