"""Conversation history as an append-only token sequence.

Each turn's prompt must extend the previous one token for token, or vLLM's prefix
cache misses and every turn pays for the whole history again. So the history is kept
as token ids that only grow: a new message is rendered with the model's chat template,
and only the *new* text (the rendered conversation minus what was rendered before) is
tokenised and appended. Special tokens sit at every message border, so tokenising the
pieces separately gives the same ids as tokenising the whole.

A reply is appended as the model saw it: the generation prompt it was asked with,
then its text. Templates such as Qwen3's render a past reply differently from the
prompt that produced it (the empty ``<think></think>`` block of non-thinking mode is
dropped from history); re-rendering would change tokens the KV cache already holds.

Each message's ids are kept apart (``_parts``), so nothing is re-tokenised when the
history changes at the front: a trim drops the oldest parts, a summary or a new
system prompt re-encodes only the system message, a replaced message only itself.
That keeps the event loop free (a full re-encode of a long history takes tens of ms
and stalls every session's pacer) and is exact because a message's rendering does
not depend on what precedes it once the system message is in place (the segment is
rendered mid-conversation, see :meth:`Conversation._segment`).

Tools (voicebot/tools) keep this append-only: their schemas are rendered into the
system message by the template itself (``tools=``), so a session's tools cost one
system re-encode when they change and nothing per turn; a reply that called a tool is
stored as generated (its ``<tool_call>`` markup included, as the model will see it
again); a tool result is a ``tool`` message, rendered with the system message alone
before it, so two results in a row are two complete turns whose tokens never change
(the template would otherwise merge them and re-render the first).

The history is bounded by a token budget. When a reply could overflow it, the oldest
turns are dropped (down to ``trim_to`` of the budget, so this happens rarely: each
trim costs one prefix-cache miss). Dropped turns are handed back so the session can
summarise them at background priority.

Dropping turns at the front moves every kept token, so nothing of the kept history is
cached after a trim; on a CPU, prefilling it again takes seconds. So the session
compacts ahead of the budget instead: from ``compact_at`` of it, the turns a trim would
drop (:meth:`trim_plan`) are summarised while the history stays as it is, the history
they leave (:meth:`compacted_ids`) is prefilled, and only then swapped in
(:meth:`compact`). :meth:`trim` at the budget itself remains the hard limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class Message:
    role: Role
    content: str
    item_id: str | None = None
    # An assistant turn that is only a call a client added (Realtime function_call
    # item): [{"name": ..., "arguments": {...}}], rendered by the template.
    tool_calls: tuple[dict[str, Any], ...] | None = None
    call_id: str | None = None  # a tool result's call, or the call of a client-added call

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [{"type": "function", "function": dict(c)} for c in self.tool_calls]
        return d


_PLACEHOLDER = Message("user", "...")
_TRAILING_MARKS = ".,;:!?…"


def _after_overlap(generated: list[int], tail: list[int]) -> list[int]:
    """``tail`` minus what ``generated`` already ends with (the end-of-turn token the
    model emitted is also the first token of the template's closing)."""
    for k in range(min(len(generated), len(tail)), 0, -1):
        if list(generated[-k:]) == tail[:k]:
            return tail[k:]
    return tail


class Conversation:
    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str,
        budget_tokens: int,
        reply_tokens: int,
        trim_to: float = 0.6,
        compact_at: float = 0.8,
    ) -> None:
        self._tok = tokenizer
        self.system_prompt = system_prompt
        self.budget_tokens = budget_tokens
        self.reply_tokens = reply_tokens
        self.trim_to = trim_to
        self.compact_at = compact_at
        self.summary: str | None = None
        self.tools: list[dict[str, Any]] = []  # Chat Completions shape, rendered by the template
        self.messages: list[Message] = []
        self._system_ids: list[int] = []
        self._parts: list[list[int]] = []  # ids of each message, as in the prompt
        self._ids: list[int] = []  # system ids + every part: the prompt so far
        self._placeholder_text = ""
        self.rebuilds = 0  # full re-encodes of the history (only the first, so far)
        self._encode_system()
        self._ids = list(self._system_ids)
        self.rebuilds += 1

    # ----------------------------------------------------------------- rendering
    def _system_message(self, summary: str | None = None) -> Message:
        content = self.system_prompt
        summary = self.summary if summary is None else summary
        if summary:
            content += "\n\nEarlier in this call: " + summary
        return Message("system", content)

    def _render(
        self, messages: list[Message], generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        tools = self.tools if tools is None else tools
        return self._tok.apply_chat_template(
            [m.as_dict() for m in messages],
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            enable_thinking=False,  # ignored by templates without a thinking mode
        )

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def _all(self) -> list[Message]:
        return [self._system_message(), *self.messages]

    def _segment(self, history: list[Message], message: Message) -> str:
        """How the template renders ``message`` after ``history``, mid-conversation.

        Rendered with a placeholder user turn after it: some templates (Qwen3) render
        the turns after the last user message differently, and a message must get the
        form it will keep once the conversation goes on.
        """
        base = self._render([*history, _PLACEHOLDER], False)
        grown = self._render([*history, message, _PLACEHOLDER], False)
        tail = self._placeholder_text
        if base.endswith(tail) and grown.endswith(tail) and grown.startswith(base[: -len(tail)]):
            return grown[len(base) - len(tail) : len(grown) - len(tail)]
        # A template that does not fit the pattern: plain difference of renders.
        before = self._render(history, False)
        after = self._render([*history, message], False)
        return after[len(before) :] if after.startswith(before) else after

    def _generation_text(self, history: list[Message]) -> str:
        """What the template adds to ask for a reply (e.g. '<|im_start|>assistant\\n')."""
        plain = self._render(history, False)
        full = self._render(history, True)
        return full[len(plain) :] if full.startswith(plain) else ""

    @staticmethod
    def _context(history: list[Message], message: Message | None = None) -> list[Message]:
        """The part of the history a new message is rendered after: the system message
        and the message just before it. Rendering the whole history each turn cost
        ~4 ms of event-loop time per turn on a long call (Jinja over every message,
        several times), which at hundreds of sessions per process was most of the
        loop's time; the rendering of a message does not depend on the rest.
        A tool result is rendered after the system message alone: templates merge
        consecutive results into one turn, which would change the first one's tokens."""
        if message is not None and message.role == "tool":
            return history[:1]
        return history if len(history) <= 2 else [history[0], history[-1]]

    def _message_ids(
        self, history: list[Message], message: Message, token_ids: list[int] | None = None
    ) -> list[int]:
        history = self._context(history, message)
        segment = self._segment(history, message)
        if message.role == "assistant" and message.content:
            at = segment.rfind(message.content)
            if at >= 0:
                # As generated: the generation prompt it answered, its text, the closing.
                generation = self._generation_text(history)
                if token_ids:
                    tail = self._encode(segment[at + len(message.content) :])
                    return self._encode(generation) + list(token_ids) + _after_overlap(token_ids, tail)
                segment = generation + segment[at:]
        return self._encode(segment)

    def _encode_system(self) -> None:
        system = self._system_message()
        plain = self._render([system], False)
        self._placeholder_text = self._render([system, _PLACEHOLDER], False)[len(plain) :]
        self._system_ids = self._encode(plain)

    def _system_ids_for(self, system_prompt: str | None, tools: list[dict[str, Any]] | None) -> list[int]:
        """The system message of one reply with other instructions and/or tools (a
        Realtime response.create override). The messages after it render the same."""
        if system_prompt is None and tools is None:
            return self._system_ids
        content = self.system_prompt if system_prompt is None else system_prompt
        if self.summary:
            content += "\n\nEarlier in this call: " + self.summary
        return self._encode(self._render([Message("system", content)], False, tools))

    def _join(self) -> None:
        """The prompt from its parts: list copies only, no tokenising."""
        ids = list(self._system_ids)
        for part in self._parts:
            ids.extend(part)
        self._ids = ids

    def _system_changed(self) -> None:
        self._encode_system()
        self._join()

    # -------------------------------------------------------------------- public
    @property
    def token_count(self) -> int:
        return len(self._ids)

    def append(
        self,
        role: Role,
        content: str,
        item_id: str | None = None,
        token_ids: list[int] | None = None,
        *,
        tool_calls: list[dict[str, Any]] | None = None,
        call_id: str | None = None,
    ) -> None:
        """Add a message. ``token_ids``: an assistant reply exactly as the model generated
        it (its text must be ``content``), so the next prompt matches the KV cache.
        ``tool_calls``: an assistant call added by a client; ``call_id``: a tool result's."""
        content = content.strip()
        if not content and not tool_calls and role != "tool":
            return
        message = Message(role, content, item_id, tuple(tool_calls) if tool_calls else None, call_id)
        part = self._message_ids(self._all(), message, token_ids)
        self._parts.append(part)
        self._ids.extend(part)
        self.messages.append(message)

    def replace(self, item_id: str, content: str) -> bool:
        """Rewrite one message (a reply cut short after the fact); costs a re-encode."""
        for i, m in enumerate(self.messages):
            if m.item_id == item_id:
                if content.strip() or m.tool_calls:
                    self.messages[i] = Message(m.role, content.strip(), item_id, m.tool_calls, m.call_id)
                    # Only this message is re-encoded (as text now: it was cut short).
                    self._parts[i] = self._message_ids([self._system_message(), *self.messages[:i]], self.messages[i])
                else:
                    del self.messages[i]
                    del self._parts[i]
                self._join()
                return True
        return False

    def delete(self, item_id: str) -> bool:
        return self.replace(item_id, "")

    def history_ids(self) -> list[int]:
        """The conversation so far (system message and every message): the start of
        the next prompt, whatever the caller says."""
        return list(self._ids)

    def prompt_ids(
        self,
        user_text: str | None = None,
        *,
        system_prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids that ask the model for the next assistant reply.

        ``user_text`` adds a user message to the prompt without committing it to the
        history: a speculative reply for a turn that may not be over yet.
        ``system_prompt`` / ``tools``: this reply only (a per-response override; its
        prompt shares no cached prefix with the others).
        """
        history = self._context(self._all())
        ids = list(self._ids)
        if system_prompt is not None or tools is not None:
            ids[: len(self._system_ids)] = self._system_ids_for(system_prompt, tools)
        if user_text and user_text.strip():
            message = Message("user", user_text.strip())
            ids.extend(self._message_ids(history, message))
            history = [history[0], message]
        return ids + self._encode(self._generation_text(history))

    def user_prefix_ids(self, words: str) -> list[int]:
        """The start of the next prompt while the caller is still speaking: the history,
        then a user message that begins with ``words`` (the transcript so far), cut
        where they end. The prompt of the finished turn starts with these ids when its
        transcript starts with ``words`` at a word boundary: the template's closing
        follows the words, and the tokeniser splits before each space-led word.
        Punctuation ending ``words`` is left out: a hypothesis of speech that goes on
        ends in a full stop that the finished sentence may not have there, and the
        tokeniser keeps marks apart from the word before them."""
        words = words.strip().rstrip(_TRAILING_MARKS).rstrip()
        history = self._context(self._all())
        ids = list(self._ids)
        if not words:
            return ids
        segment = self._segment(history, Message("user", words))
        at = segment.rfind(words)
        if at < 0:
            return ids  # a template that rewrites the text: nothing to share
        return ids + self._encode(segment[: at + len(words)])

    def set_system_prompt(self, prompt: str) -> None:
        if prompt != self.system_prompt:
            self.system_prompt = prompt
            self._system_changed()

    def set_tools(self, tools: list[dict[str, Any]]) -> None:
        """The tools rendered into the system message (Chat Completions shape)."""
        if tools != self.tools:
            self.tools = list(tools)
            self._system_changed()

    @property
    def _reserved(self) -> int:
        """Room kept for the next reply, at most half the budget: a reply as long as the
        budget (a client's max_tokens of 4096 against 1536) trimmed the whole history at
        every turn, and the call had no memory."""
        return min(self.reply_tokens, self.budget_tokens // 2)

    def over_budget(self) -> bool:
        return self.token_count + self._reserved > self.budget_tokens

    def near_budget(self) -> bool:
        """Past ``compact_at`` of the budget: time to summarise the turns the next trim
        would drop, while the history still holds them (the session's compaction)."""
        return self.token_count + self._reserved > self.budget_tokens * self.compact_at

    def room(self) -> int:
        """Tokens the history may still grow by before the hard trim."""
        return self.budget_tokens - self._reserved - self.token_count

    def _drop_count(self) -> int:
        """How many of the oldest messages a trim drops: down to ``trim_to`` of the budget."""
        target = max(int(self.budget_tokens * self.trim_to) - self._reserved, 0)
        # The latest turn stays whatever the target: a long system message (a Realtime
        # client's instructions and tools) can be over it alone, and the loop then dropped
        # the question or tool result just added, so the reply was asked nothing.
        users = [i for i, m in enumerate(self.messages) if m.role == "user"]
        keep_from = users[-1] if users else len(self.messages) - 1
        count = len(self._ids)
        n = 0
        while n < keep_from and count > target:
            count -= len(self._parts[n])
            n += 1
            # Never start the kept history with an assistant turn or an orphan tool result.
            while n < keep_from and self.messages[n].role in ("assistant", "tool"):
                count -= len(self._parts[n])
                n += 1
        return n

    def trim(self) -> list[Message]:
        """Drop the oldest turns until under ``trim_to`` of the budget; return them."""
        if not self.over_budget():
            return []
        return self._drop(self._drop_count())

    def _drop(self, n: int) -> list[Message]:
        dropped = self.messages[:n]
        del self.messages[:n]
        del self._parts[:n]
        self._join()
        return dropped

    def trim_plan(self) -> list[Message]:
        """The messages a trim would drop now (nothing is dropped)."""
        return self.messages[: self._drop_count()]

    def _starts_with(self, head: list[Message]) -> bool:
        # By identity: a message a client replaced or deleted since is another one.
        return len(head) <= len(self.messages) and all(a is b for a, b in zip(head, self.messages, strict=False))

    def compacted_ids(self, head: list[Message], summary: str | None) -> list[int] | None:
        """The history as :meth:`compact` would leave it: ``head`` dropped (none: a trim's
        summary, the turns already gone), ``summary`` in the system message. None when the
        history no longer starts with ``head``."""
        if not self._starts_with(head):
            return None
        ids = self._encode(self._render([self._system_message((summary or "").strip())], False))
        for part in self._parts[len(head) :]:
            ids.extend(part)
        return ids

    def compact(self, head: list[Message], summary: str | None) -> bool:
        """Drop ``head`` and set ``summary`` at once: one change of the prompt's start, not
        two. False (nothing changed) when the history no longer starts with ``head``."""
        if not self._starts_with(head):
            return False
        self._drop(len(head))
        self.set_summary(summary or "")
        return True

    def set_summary(self, summary: str) -> None:
        self.summary = summary.strip() or None
        self._system_changed()
