"""A started LLM engine leaves nothing for a session's first tool-aware reply to import.

Every reply builds vLLM's tool parser, and one with tools its grammar (voicebot/tools/);
those modules are imported inside the functions that use them. Imported on the event
loop by the first reply, they held every call of a frontend for the import's time. The
engine imports them in a thread while it starts (voicebot/tools/preload.py).

Checked in a fresh interpreter, since another test may have imported them already: the
remote backend (what a frontend of the scale-out layout runs) is started against a
minimal HTTP tier that only lists its model, then a reply's whole tool plan is built
(parser stream, fed markup, every tool_choice's grammar) and no module may appear.
Without the preload the same plan imports ``vllm.tool_parsers`` and the test fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# A real LLM backend started in a fresh interpreter (vLLM's import alone takes seconds).
pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, json, sys

from voicebot.config import Config
from voicebot.engines.llm.remote import RemoteLlmEngine
from voicebot.tools.session_tools import SessionTools
from voicebot.tools.spec import ToolChoice, ToolSpec

MODELS = json.dumps({"data": [{"id": "fake"}]}).encode()


async def tier(reader, writer):
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                 b"connection: close\r\n\r\n%s" % (len(MODELS), MODELS))
    await writer.drain()
    writer.close()


class Options:
    def __init__(self, tools, choice):
        self.tools, self.tool_choice = tools, choice


async def main(tokenizer_dir):
    server = await asyncio.start_server(tier, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = Config.model_validate({"llm": {"backend": "remote", "remote": {"url": f"http://127.0.0.1:{port}"}}})
    engine = RemoteLlmEngine(cfg.llm, tokenizer_dir)
    await engine.start()
    before = set(sys.modules)
    weather = ToolSpec("weather", "The weather in a city.",
                       {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    tools = SessionTools(cfg, engine.tokenizer, "native")
    for choice in ("auto", "required", "none"):
        plan = tools.plan(Options([weather], ToolChoice(choice)))
        plan.stream.feed('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>')
        plan.stream.finish()
        plan.constraint.sampling_kwargs()
    tools.plan(Options([], None)).stream.feed("Hello there.")
    await engine.aclose()
    server.close()
    print(json.dumps(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("vllm", "xgrammar"))))


asyncio.run(main(sys.argv[1]))
"""


def imported_by_first_replies(tokenizer_dir: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tokenizer_dir],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_first_tool_aware_reply_imports_nothing_after_the_engine_started(
    bundle_dir: Callable[[str], str],
) -> None:
    tokenizer_dir = bundle_dir("qwen3-tokenizer")
    late = imported_by_first_replies(tokenizer_dir)
    assert late == [], f"imported on the event loop by the first replies: {late}"
