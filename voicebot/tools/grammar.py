"""How a reply's tool calls are constrained: vLLM structured outputs (a structural tag).

A 0.5B model writes a tool call's JSON wrong often enough to matter (a missing brace,
an argument the schema does not have). vLLM's structural tags fix that at decoding
time: the reply is free text until the model emits the parser's start tag
(``<tool_call>``); from there the grammar allows only ``{"name": <a declared tool>,
"arguments": <JSON valid for that tool's schema>}`` and the end tag. The tag is built
by vLLM's own registry (``structural_tag_registry.get_model_structural_tag``) for the
parser's format, at vLLM's strictest level (every argument schema enforced), and limited
to one call per reply (vLLM's ``limit_to_single_tool_call``: the voice loop runs one
tool round at a time).

By ``tool_choice``:
- ``auto``: the triggered tag above (``llm.tool_grammar: always``) or no grammar
  (``forced``/``off``: the model's own JSON, parsed after the fact);
- ``required`` / a named function: the reply *must* be a call (to that function), from
  its first token (``always``/``forced``); ``off`` leaves it to the prompt;
- ``none``: the tools stay in the system prompt (the prefix cache depends on it) and
  the start tag's token is banned with a logit bias, so no call can begin.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from voicebot.tools.parser import parser_class, structural_tag_model
from voicebot.tools.spec import ToolChoice, ToolSpec

GrammarMode = Literal["always", "forced", "off"]
_BAN = -100.0  # vLLM clamps logit biases to [-100, 100]: effectively never sampled


@dataclass(frozen=True)
class Constraint:
    """What one reply's SamplingParams get: a structural tag (JSON) and/or a logit bias.
    ``tools``: tools are in the prompt, so the call markup must stay in the text."""

    structural_tag: str | None = None
    logit_bias: dict[int, float] | None = None
    tools: bool = False

    def sampling_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"skip_special_tokens": False} if self.tools else {}
        if self.structural_tag is not None:
            from vllm.sampling_params import StructuredOutputsParams

            kw["structured_outputs"] = StructuredOutputsParams(structural_tag=self.structural_tag)
        if self.logit_bias:
            kw["logit_bias"] = self.logit_bias
        return kw


NO_CONSTRAINT = Constraint()


def start_tag_token(tokenizer: Any, parser: str) -> int | None:
    """The single token that opens a call (``<tool_call>`` on Qwen), if there is one."""
    tag = getattr(parser_class(parser), "tool_call_start_token", None)
    if not isinstance(tag, str):
        return None
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def structural_tag(parser: str, tools: Sequence[ToolSpec], choice: ToolChoice) -> str | None:
    """vLLM's structural tag for ``parser``'s call format (None: the parser has none)."""
    model = structural_tag_model(parser)
    if model is None or not tools or choice.mode == "none":
        return None
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
        ChatCompletionToolsParam,
    )
    from vllm.tool_parsers.structural_tag_registry import (
        get_model_structural_tag,
        limit_to_single_tool_call,
    )
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    wire: Any = choice.mode
    if choice.mode == "function":
        wire = ChatCompletionNamedToolChoiceParam.model_validate({"type": "function", "function": {"name": choice.name}})
    tag = get_model_structural_tag(
        model=model,
        tools=[ChatCompletionToolsParam.model_validate(t.as_chat_tool()) for t in tools],
        tool_choice=wire,
        reasoning=False,
        strict_level=ToolStrictLevel.PARAMETER,
    )
    if tag is None:
        return None
    limit_to_single_tool_call(tag)
    _bound_whitespace(tag.format)
    tag.format = _no_bare_calls(tag.format)
    return json.dumps(tag.model_dump())


def _no_bare_calls(fmt: Any) -> Any:
    """``auto``: the reply is a call opened by its start tag, or text that does not open
    like one. Qwen2.5-Coder-0.5B often writes a call as bare JSON (``{"name": ...}`` without
    ``<tool_call>``): no parser sees that as a call, the grammar's trigger never fires,
    and the caller would hear the JSON read out. Masking ``{`` / ``[`` / ``<`` (and
    leading whitespace) as a reply's first character leaves the model the start tag
    instead, which it then must complete as a valid call of a declared tool."""
    from xgrammar.structural_tag import (
        OrFormat,
        RegexFormat,
        SequenceFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    if not isinstance(fmt, TriggeredTagsFormat):
        return fmt  # required / named: already a call from the first token
    call = TagsWithSeparatorFormat(tags=fmt.tags, separator="", at_least_one=True, stop_after_first=True)
    # Spoken text never needs braces or code fences: the only way to JSON is the tag.
    fmt.excludes = [*fmt.excludes, *_NOT_SPOKEN]
    text = SequenceFormat(elements=[RegexFormat(pattern=_FIRST_CHAR), fmt])
    return OrFormat(elements=[call, text])


def spoken_text_tag() -> str:
    """A reply that is text only: no markup first, no braces or code fences at all."""
    from xgrammar.structural_tag import AnyTextFormat, RegexFormat, SequenceFormat, StructuralTag

    fmt = SequenceFormat(elements=[RegexFormat(pattern=_FIRST_CHAR), AnyTextFormat(excludes=list(_NOT_SPOKEN))])
    return json.dumps(StructuralTag(format=fmt).model_dump())


_FIRST_CHAR = r"[^\s{}\[\]<>`*#|]"  # a spoken reply does not open with markup
# Text a spoken reply never contains; Qwen2.5-Coder-0.5B wrapped calls in them ("```json {...}").
_NOT_SPOKEN = ["{", "}", "```"]


def _bound_whitespace(node: Any) -> None:
    """At most one whitespace character in a row inside a call's JSON: the arguments
    stay short however the model samples (a run of newlines inside the object would
    otherwise be valid JSON until max_tokens cuts the call)."""
    from pydantic import BaseModel
    from xgrammar.structural_tag import JSONSchemaFormat

    if isinstance(node, JSONSchemaFormat):
        node.max_whitespace_cnt = 1
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            _bound_whitespace(getattr(node, name))
    elif isinstance(node, list | tuple):
        for item in node:
            _bound_whitespace(item)


def constraint_for(
    tokenizer: Any, parser: str, tools: Sequence[ToolSpec], choice: ToolChoice, mode: GrammarMode
) -> Constraint:
    """The constraint of one reply, given the tools rendered in its prompt."""
    if not tools:
        return NO_CONSTRAINT
    if choice.mode == "none":
        token = start_tag_token(tokenizer, parser)
        text = spoken_text_tag() if mode == "always" else None  # no bare-JSON "call" either
        return Constraint(text, logit_bias={token: _BAN} if token is not None else None, tools=True)
    if mode == "off" or (mode == "forced" and not choice.forces_call()):
        return Constraint(tools=True)
    return Constraint(structural_tag=structural_tag(parser, tools, choice), tools=True)
