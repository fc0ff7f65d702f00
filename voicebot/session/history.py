"""Conversation history as an append-only token sequence.

Each turn's prompt must extend the previous one token for token, or vLLM's prefix
cache misses and every turn pays for the whole history again. So the history is kept
as token ids that only grow: a new message is rendered with the model's chat template,
and only the *new* text (the rendered conversation minus what was rendered before) is
tokenised and appended. Special tokens sit at every message border, so tokenising the
pieces separately gives the same ids as tokenising the whole.

The history is bounded by a token budget. When a reply could overflow it, the oldest
turns are dropped (down to ``trim_to`` of the budget, so this happens rarely: each
trim costs one full re-encode and one prefix-cache miss). Dropped turns are handed
back so the session can summarise them at background priority.
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
        self._text = ""
        self._ids: list[int] = []
        self.rebuilds = 0
        self._rebuild()

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

    def _rebuild(self) -> None:
        self._text = self._render(self._all(), generation_prompt=False)
        self._ids = self._encode(self._text)
        self.rebuilds += 1

    # -------------------------------------------------------------------- public
    @property
    def token_count(self) -> int:
        return len(self._ids)

    def append(self, role: Role, content: str, item_id: str | None = None) -> None:
        content = content.strip()
        if not content:
            return
        self.messages.append(Message(role, content, item_id))
        text = self._render(self._all(), generation_prompt=False)
        if text.startswith(self._text):
            self._ids.extend(self._encode(text[len(self._text) :]))
            self._text = text
        else:
            # The template re-rendered earlier turns (some do for the last assistant
            # message); stay correct and pay one cache miss.
            log.debug("chat template is not append-only here; re-encoding history")
            self._rebuild()

    def replace(self, item_id: str, content: str) -> bool:
        """Rewrite one message (a reply cut short after the fact); costs a re-encode."""
        for i, m in enumerate(self.messages):
            if m.item_id == item_id:
                if content.strip():
                    self.messages[i] = Message(m.role, content.strip(), item_id)
                else:
                    del self.messages[i]
                self._rebuild()
                return True
        return False

    def delete(self, item_id: str) -> bool:
        return self.replace(item_id, "")

    def prompt_ids(self, user_text: str | None = None) -> list[int]:
        """The token ids that ask the model for the next assistant reply.

        ``user_text`` adds a user message to the prompt without committing it to the
        history: a speculative reply for a turn that may not be over yet.
        """
        messages = self._all()
        if user_text:
            messages.append(Message("user", user_text.strip()))
        full = self._render(messages, generation_prompt=True)
        if full.startswith(self._text):
            return self._ids + self._encode(full[len(self._text) :])
        return self._encode(full)

    def set_system_prompt(self, prompt: str) -> None:
        if prompt != self.system_prompt:
            self.system_prompt = prompt
            self._rebuild()

    def over_budget(self) -> bool:
        return self.token_count + self.reply_tokens > self.budget_tokens

    def trim(self) -> list[Message]:
        """Drop the oldest turns until under ``trim_to`` of the budget; return them."""
        if not self.over_budget():
            return []
        target = int(self.budget_tokens * self.trim_to) - self.reply_tokens
        dropped: list[Message] = []
        while self.messages and self.token_count > max(target, 0):
            dropped.append(self.messages.pop(0))
            # Never start the kept history with an assistant turn.
            while self.messages and self.messages[0].role == "assistant":
                dropped.append(self.messages.pop(0))
            self._rebuild()
        return dropped

    def set_summary(self, summary: str) -> None:
        self.summary = summary.strip() or None
        self._rebuild()
