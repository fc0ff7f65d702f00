"""One session's tools: what the model is shown, and how each reply may use them.

Synchronous bookkeeping for :class:`~voicebot.session.session.Session`, which only asks
it for a reply's *plan* (tools, tool_choice, parser, constraint) and, on a server-tool
session, runs the calls through it. Two kinds of session:

- client tools (Realtime): the client declares ``session.tools`` / ``tool_choice`` and
  runs the calls itself; the session only streams them out and takes the results in.
- server tools (``tools.server`` in the config, for ``tools.transports``): the session
  runs each call as a webhook and goes on to the next reply itself, up to
  ``tools.max_rounds`` calls in a row; a forced ``tool_choice`` applies to the first
  reply of a turn only (a forced call after every result would never end), and the
  reply after the last allowed round may not call a tool at all.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from voicebot.config import Config
from voicebot.tools.grammar import Constraint, constraint_for
from voicebot.tools.parser import ToolCallStream
from voicebot.tools.spec import ToolCall, ToolChoice, ToolSpec
from voicebot.tools.webhook import WebhookTools


class ToolOptions(Protocol):
    """A reply's own tool settings, None where the session's apply (the session's
    ``ResponseOptions``; declared here so that tools import no session module)."""

    @property
    def tools(self) -> list[ToolSpec] | None: ...

    @property
    def tool_choice(self) -> ToolChoice | None: ...

_CONSTRAINTS = 8  # distinct (tools, choice) constraints kept per session: each is a few kB of JSON


@dataclass(frozen=True)
class ReplyPlan:
    tools: list[ToolSpec]
    choice: ToolChoice
    stream: ToolCallStream
    constraint: Constraint
    prompt_tools: list[dict[str, Any]] | None  # None: the session's own (already in the prompt)


class SessionTools:
    def __init__(self, cfg: Config, tokenizer: Any, transport: str) -> None:
        self._cfg = cfg.tools
        self._parser = cfg.llm.tool_parser
        self._grammar = cfg.llm.tool_grammar
        self._tok = tokenizer
        server = bool(cfg.tools.server) and transport in cfg.tools.transports
        self.runner: WebhookTools | None = (
            WebhookTools(cfg.tools.server, cfg.tools.max_result_chars) if server else None
        )
        self.tools: list[ToolSpec] = self.runner.specs if self.runner else []
        self.choice = ToolChoice(cfg.tools.tool_choice) if self.runner else ToolChoice()
        self._constraints: collections.OrderedDict[str, Constraint] = collections.OrderedDict()

    # ---------------------------------------------------------------- declared
    def set(self, tools: Sequence[ToolSpec] | None = None, choice: ToolChoice | None = None) -> None:
        """A client's ``session.tools`` / ``tool_choice`` (either may be left as is)."""
        new_tools = self.tools if tools is None else list(tools)
        new_choice = self.choice if choice is None else choice
        new_choice.check(new_tools)
        self.tools, self.choice = new_tools, new_choice

    def chat_tools(self, tools: Sequence[ToolSpec] | None = None) -> list[dict[str, Any]]:
        return [t.as_chat_tool() for t in (self.tools if tools is None else tools)]

    @property
    def max_result_chars(self) -> int:
        return self._cfg.max_result_chars

    # ------------------------------------------------------------------- plans
    def plan(self, options: ToolOptions, tool_round: int = 0, after_result: bool = False) -> ReplyPlan:
        """``after_result``: the history ends with a tool result (the reply is its answer)."""
        tools = self.tools if options.tools is None else options.tools
        choice = options.tool_choice or self.choice
        choice.check(tools)
        if tool_round > 0 and choice.forces_call():
            choice = ToolChoice("auto")
        if after_result and options.tool_choice is None and self._cfg.answer_after_result:
            choice = ToolChoice("none")
        if self.runner is not None and tool_round >= self._cfg.max_rounds:
            choice = ToolChoice("none")  # enough calls in a row: now answer
        return ReplyPlan(
            tools,
            choice,
            ToolCallStream(self._tok, self._parser, tools, choice),
            self._constraint(tools, choice),
            None if options.tools is None else self.chat_tools(options.tools),
        )

    def _constraint(self, tools: list[ToolSpec], choice: ToolChoice) -> Constraint:
        key = json.dumps([self.chat_tools(tools), choice.as_wire()], sort_keys=True)
        found = self._constraints.get(key)
        if found is None:
            found = constraint_for(self._tok, self._parser, tools, choice, self._grammar)
            self._constraints[key] = found
            while len(self._constraints) > _CONSTRAINTS:
                self._constraints.popitem(last=False)
        else:
            self._constraints.move_to_end(key)
        return found

    # ------------------------------------------------------------ server tools
    def runs(self, calls: Sequence[ToolCall], tool_round: int) -> bool:
        """Whether the session runs these calls itself and replies again."""
        return self.runner is not None and bool(calls) and tool_round < self._cfg.max_rounds

    @property
    def filler(self) -> tuple[str, float]:
        return self._cfg.filler.strip(), self._cfg.filler_after_ms / 1000.0

    async def run_all(self, calls: Sequence[ToolCall], session_id: str) -> list[str]:
        """Every call's result (error results included), in call order. Cancelling
        this cancels the webhook requests still running."""
        assert self.runner is not None
        runner = self.runner
        async with asyncio.TaskGroup() as tg:
            jobs = [tg.create_task(runner.run(c, session_id)) for c in calls]
        return [j.result() for j in jobs]

    def clip(self, output: str) -> str:
        """A tool result as the model gets it: at most ``tools.max_result_chars``."""
        limit = self._cfg.max_result_chars
        return output if len(output) <= limit else output[:limit] + " [truncated]"
