"""How reliably the CPU default LLM calls tools, and what the tool grammar costs.

Runs the configured LLM (configs/default.yaml: Qwen2.5-Coder-0.5B-Instruct on vLLM CPU) on a
set of spoken-style questions with a ``get_weather`` and a ``get_time`` tool, through
the same code the server uses (Conversation rendering, vLLM's hermes parser, the
structural tag of voicebot/tools/grammar.py), for each ``llm.tool_grammar`` mode and
tool_choice, and reports per mode:

- ``called_right``: the reply called the right tool with the right city;
- ``valid_json``: every call's arguments parse and fit the schema;
- ``chatter``: questions that need no tool but got a call anyway;
- ``answer_uses_result``: after a tool result, the spoken answer contains its figure;
- TTFT and whole-reply time (ms, median), cached prompt tokens of the turn after the result.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/tool_calls.py --json artifacts/tool_calls.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from bench_util import JSON_EPILOG, summarise_ms, write_result  # benchmarks/, beside this file

from voicebot.config import load_config
from voicebot.engines.contracts import GenerationStats, Lane
from voicebot.engines.llm.inprocess import LlmEngine
from voicebot.provision import resolve_model
from voicebot.session.history import Conversation
from voicebot.tools.grammar import constraint_for
from voicebot.tools.parser import Speech, ToolCallStream
from voicebot.tools.spec import ToolChoice, ToolSpec

SYSTEM = ("You are a friendly voice assistant. Answer in one or two short spoken sentences. "
          "Use the tools for weather and time questions.")
TOOLS = [
    ToolSpec("get_weather", "Get the current weather in a city.", {
        "type": "object", "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
        "required": ["city"]}),
    ToolSpec("get_time", "Get the current local time in a city.", {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
]
ASK = [  # (question as ASR writes it, tool, city)
    ("What's the weather in Paris?", "get_weather", "Paris"),
    ("what's the weather like in london today", "get_weather", "London"),
    ("Is it raining in Berlin right now?", "get_weather", "Berlin"),
    ("How warm is it in Madrid?", "get_weather", "Madrid"),
    ("What time is it in Tokyo?", "get_time", "Tokyo"),
    ("Tell me the weather for New York.", "get_weather", "New York"),
]
CHAT = ["Hello, how are you?", "Tell me a joke about cats.", "Thanks, that's all."]
RESULT = {"get_weather": '{"temperature_c": 21, "sky": "sunny"}', "get_time": '{"time": "21:40"}'}


async def reply(engine: LlmEngine, ids: list[int], choice: ToolChoice, grammar: str,
                max_tokens: int = 64) -> dict[str, Any]:
    stream = ToolCallStream(engine.tokenizer, "hermes", TOOLS, choice)
    constraint = constraint_for(engine.tokenizer, "hermes", TOOLS, choice, grammar)  # type: ignore[arg-type]
    st = GenerationStats("", Lane.INTERACTIVE)
    text, out_ids, speech = "", [], ""
    t0 = time.monotonic()
    async with contextlib.aclosing(engine.generate(ids, max_tokens=max_tokens, stats=st, temperature=0.0,
                                                   **constraint.sampling_kwargs())) as gen:
        async for d in gen:
            text += d.text
            out_ids.extend(d.token_ids)
            speech += "".join(p.text for p in stream.feed(d.text, d.token_ids) if isinstance(p, Speech))
    return {"text": text, "ids": out_ids, "speech": speech.strip(), "calls": stream.finish(),
            "ttft_ms": 1000 * (st.ttft_s or 0.0), "total_ms": 1000 * (time.monotonic() - t0),
            "cached": st.cached_tokens}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load_config(args.config, args.override)
    engine = LlmEngine(cfg.llm, resolve_model(cfg.llm.model, cfg.models))
    await engine.start()
    report: dict[str, Any] = {"model": cfg.llm.model, "modes": {}}
    try:
        for grammar in args.grammar:
            for choice_name in args.choice:
                choice = ToolChoice(choice_name)  # type: ignore[arg-type]
                rows, ttft, total, cached = [], [], [], []
                right = valid = uses = chatter = 0
                for question, tool, city in ASK:
                    conv = Conversation(engine.tokenizer, SYSTEM, 3000, 64)
                    conv.set_tools([t.as_chat_tool() for t in TOOLS])
                    conv.append("user", question)
                    r = await reply(engine, conv.prompt_ids(), choice, grammar)
                    ttft.append(r["ttft_ms"])
                    total.append(r["total_ms"])
                    calls = r["calls"]
                    ok_json = all(c.valid and isinstance(json.loads(c.arguments), dict) for c in calls)
                    valid += ok_json and bool(calls)
                    hit = any(c.valid and c.name == tool and city.lower() in c.arguments.lower() for c in calls)
                    right += hit
                    answer = ""
                    if calls and calls[0].valid:
                        conv.append("assistant", r["text"], token_ids=r["ids"])
                        conv.append("tool", RESULT.get(calls[0].name, '{"error": "unknown"}'))
                        # As the session does (tools.answer_after_result): the answer may not call.
                        a = await reply(engine, conv.prompt_ids(), ToolChoice("none"), grammar)
                        answer = a["speech"]
                        cached.append(a["cached"])
                        uses += "21" in answer
                    rows.append({"question": question, "output": r["text"], "answer": answer})
                for question in CHAT:
                    conv = Conversation(engine.tokenizer, SYSTEM, 3000, 64)
                    conv.set_tools([t.as_chat_tool() for t in TOOLS])
                    conv.append("user", question)
                    r = await reply(engine, conv.prompt_ids(), choice, grammar)
                    chatter += bool(r["calls"])
                    rows.append({"question": question, "output": r["text"]})
                key = f"grammar={grammar},tool_choice={choice_name}"
                report["modes"][key] = {
                    "called_right": f"{right}/{len(ASK)}", "valid_json": f"{valid}/{len(ASK)}",
                    "answer_uses_result": f"{uses}/{len(ASK)}", "chatter_calls": f"{chatter}/{len(CHAT)}",
                    "ttft_ms": summarise_ms(ttft), "reply_ms": summarise_ms(total),
                    "cached_after_result_min": min(cached) if cached else None, "rows": rows,
                }
                print(key, {k: v for k, v in report["modes"][key].items() if k != "rows"}, flush=True)
    finally:
        await engine.aclose()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=JSON_EPILOG)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--override", action="append", default=[], help="section.key=value (repeatable)")
    ap.add_argument("--grammar", nargs="+", default=["always", "off"], choices=["always", "forced", "off"])
    ap.add_argument("--choice", nargs="+", default=["auto"], choices=["auto", "required", "none"])
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args()
    report = asyncio.run(run(args))
    write_result(args.json, "tool_calls", args, report)


if __name__ == "__main__":
    main()
