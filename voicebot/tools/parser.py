"""Tool calls out of the model's token stream, with vLLM's own parser for the family.

``llm.tool_parser`` names a parser of vLLM's ``ToolParserManager`` (``hermes``: the
``<tool_call>{json}</tool_call>`` format of Qwen2.5 / Qwen3 / Hermes models), the same
names as vLLM's ``--tool-call-parser``. We never parse tool markup ourselves:
:class:`ToolCallStream` feeds each delta to the parser's streaming method and turns its
``DeltaMessage`` into three kinds of pieces:

- :class:`Speech`: text outside any tool call (the parser holds back a partial
  ``<tool_`` until it knows it is not a tag): the only text that reaches TTS;
- :class:`CallStarted` / :class:`ArgumentsDelta`: a call's name, then its arguments as
  they stream (the Realtime API's ``response.function_call_arguments.delta``).

:meth:`ToolCallStream.finish` runs the parser's non-streaming method over the whole
output for the final, canonical arguments.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from voicebot.tools.spec import ToolChoice, ToolSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Speech:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    delta: str


Piece = Speech | CallStarted | ArgumentsDelta


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text; "" when the parser found no complete call
    valid: bool


@functools.cache
def parser_class(name: str) -> type[Any]:
    """vLLM's tool parser class registered under ``name`` (imported on first use)."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser(name)


def structural_tag_model(name: str) -> str | None:
    """The structural-tag format vLLM pairs with this parser (None: it has none)."""
    return getattr(parser_class(name), "structural_tag_model", None)


def _request(tools: Sequence[ToolSpec], choice: ToolChoice) -> Any:
    """A Chat Completions request carrying only what parsers read (tools, tool_choice)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    wire: Any = choice.as_wire()
    if isinstance(wire, dict):
        wire = {"type": "function", "function": {"name": choice.name}}
    return ChatCompletionRequest(
        model="voicebot", messages=[], tools=[t.as_chat_tool() for t in tools] or None,
        tool_choice=wire if tools else None,
    )


class ToolCallStream:
    """One reply's output, fed delta by delta to a fresh vLLM tool parser."""

    def __init__(self, tokenizer: Any, parser: str, tools: Sequence[ToolSpec], choice: ToolChoice) -> None:
        self._parser = parser_class(parser)(tokenizer, None)
        self._request = _request(tools, choice)
        self._text = ""
        self._ids: list[int] = []
        self._names: dict[int, str] = {}

    @property
    def text(self) -> str:
        return self._text

    def feed(self, delta: str, token_ids: Sequence[int] = ()) -> list[Piece]:
        previous, previous_ids = self._text, list(self._ids)
        self._text += delta
        self._ids.extend(token_ids)
        msg = self._parser.extract_tool_calls_streaming(
            previous, self._text, delta, previous_ids, list(self._ids), list(token_ids), self._request
        )
        if msg is None:
            return []
        out: list[Piece] = []
        if msg.content:
            out.append(Speech(msg.content))
        for tc in msg.tool_calls or []:
            fn = tc.function
            name = getattr(fn, "name", None) if fn is not None else None
            args = getattr(fn, "arguments", None) if fn is not None else None
            if name and tc.index not in self._names:
                self._names[tc.index] = name
                out.append(CallStarted(tc.index, name))
            if args:
                out.append(ArgumentsDelta(tc.index, args))
        return out

    def finish(self) -> list[ParsedCall]:
        """Every call of the whole output, arguments as canonical JSON text. A call
        whose JSON does not parse (cut at max_tokens, no grammar) comes back invalid."""
        info = self._parser.extract_tool_calls(self._text, self._request)
        if info.tools_called:
            return [ParsedCall(c.function.name, c.function.arguments, True) for c in info.tool_calls]
        # Started calls the parser could not complete: reported, never run.
        return [ParsedCall(name, "", False) for _, name in sorted(self._names.items())]
