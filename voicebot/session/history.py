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

The history is bounded by a token budget. When a reply could overflow it, the oldest
turns are dropped (down to ``trim_to`` of the budget, so this happens rarely: each
trim costs one prefix-cache miss). Dropped turns are handed back so the session can
summarise them at background priority.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class Message:
    role: Role
    content: str
    item_id: str | None = None


_PLACEHOLDER = Message("user", "...")


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
    ) -> None:
        self._tok = tokenizer
        self.system_prompt = system_prompt
        self.budget_tokens = budget_tokens
        self.reply_tokens = reply_tokens
        self.trim_to = trim_to
        self.summary: str | None = None
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
    def _system_message(self) -> Message:
        content = self.system_prompt
        if self.summary:
            content += "\n\nEarlier in this call: " + self.summary
        return Message("system", content)

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
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
    def _context(history: list[Message]) -> list[Message]:
        """The part of the history a new message is rendered after: the system message
        and the message just before it. Rendering the whole history each turn cost
        ~4 ms of event-loop time per turn on a long call (Jinja over every message,
        several times), which at hundreds of sessions per process was most of the
        loop's time; the rendering of a message does not depend on the rest."""
        return history if len(history) <= 2 else [history[0], history[-1]]

    def _message_ids(
        self, history: list[Message], message: Message, token_ids: list[int] | None = None
    ) -> list[int]:
        history = self._context(history)
        segment = self._segment(history, message)
        if message.role == "assistant":
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
        self, role: Role, content: str, item_id: str | None = None, token_ids: list[int] | None = None
    ) -> None:
        """Add a message. ``token_ids``: an assistant reply exactly as the model generated
        it (its text must be ``content``), so the next prompt matches the KV cache."""
        content = content.strip()
        if not content:
            return
        message = Message(role, content, item_id)
        part = self._message_ids(self._all(), message, token_ids)
        self._parts.append(part)
        self._ids.extend(part)
        self.messages.append(message)

    def replace(self, item_id: str, content: str) -> bool:
        """Rewrite one message (a reply cut short after the fact); costs a re-encode."""
        for i, m in enumerate(self.messages):
            if m.item_id == item_id:
                if content.strip():
                    self.messages[i] = Message(m.role, content.strip(), item_id)
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

    def prompt_ids(self, user_text: str | None = None) -> list[int]:
        """The token ids that ask the model for the next assistant reply.

        ``user_text`` adds a user message to the prompt without committing it to the
        history: a speculative reply for a turn that may not be over yet.
        """
        history = self._context(self._all())
        ids = list(self._ids)
        if user_text and user_text.strip():
            message = Message("user", user_text.strip())
            ids.extend(self._message_ids(history, message))
            history = [history[0], message]
        return ids + self._encode(self._generation_text(history))

    def set_system_prompt(self, prompt: str) -> None:
        if prompt != self.system_prompt:
            self.system_prompt = prompt
            self._system_changed()

    def over_budget(self) -> bool:
        return self.token_count + self.reply_tokens > self.budget_tokens

    def trim(self) -> list[Message]:
        """Drop the oldest turns until under ``trim_to`` of the budget; return them."""
        if not self.over_budget():
            return []
        target = max(int(self.budget_tokens * self.trim_to) - self.reply_tokens, 0)
        count = len(self._ids)
        n = 0
        while n < len(self.messages) and count > target:
            count -= len(self._parts[n])
            n += 1
            # Never start the kept history with an assistant turn.
            while n < len(self.messages) and self.messages[n].role == "assistant":
                count -= len(self._parts[n])
                n += 1
        dropped = self.messages[:n]
        del self.messages[:n]
        del self._parts[:n]
        self._join()
        return dropped

    def set_summary(self, summary: str) -> None:
        self.summary = summary.strip() or None
        self._system_changed()
