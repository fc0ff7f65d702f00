"""Import at start-up what a session's first reply would otherwise import on the event loop.

Every reply builds vLLM's tool parser for the family (:mod:`.parser`: each reply's
``ToolCallStream``, tools or not) and a tool-aware one its grammar (:mod:`.grammar`:
vLLM's structural tags, xgrammar). Those modules are imported where they are used, so
that the engines' modules load without vLLM; imported on the loop, they would hold every
call of the process for as long as the import takes. An LLM engine calls
:func:`preload_tools` in a thread while it starts, whichever backend it is.
"""

from __future__ import annotations

import importlib
import logging

from voicebot.tools.parser import parser_class

log = logging.getLogger(__name__)

__all__ = ["TOOL_MODULES", "preload_tools"]

# What parser.py and grammar.py import inside their functions.
TOOL_MODULES = (
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.sampling_params",
    "vllm.tool_parsers.structural_tag_registry",
    "vllm.tool_parsers.tool_strict_level",
    "xgrammar.structural_tag",
)


def preload_tools(parser: str) -> None:
    """Import vLLM's tool parser ``parser`` (KeyError: vLLM has none of that name) and
    the modules a reply's tool parsing and grammar use."""
    parser_class(parser)
    for name in TOOL_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # An older vLLM (the GPU machines' 0.26) lacks some grammar modules: a server
            # without tools never needs them, and a tool-aware turn fails as it would have.
            log.warning("tool grammar: %s is not in this vLLM (%s): tool_choice grammars will fail", name, exc)
