"""Function tools without engines: declarations, vLLM's own parser and grammar for the
Qwen family, a reply that calls a tool (fake LLM and TTS), the session's tool plans,
webhooks against a local HTTP server, and the Realtime wire shapes (checked against
the openai SDK's own event types)."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter
from servers import serve_routes
from transformers import AutoTokenizer

from voicebot.config import Config, ServerToolConfig, load_config
from voicebot.engines.contracts import TextDelta
from voicebot.errors import ConfigError
from voicebot.session import events as se
from voicebot.session.response import Response, ResponseOptions
from voicebot.session.settings import SessionSettings
from voicebot.tools.grammar import constraint_for
from voicebot.tools.parser import ArgumentsDelta, CallStarted, Speech, ToolCallStream
from voicebot.tools.session_tools import SessionTools
from voicebot.tools.spec import (
    ToolCall,
    ToolChoice,
    ToolError,
    ToolSpec,
    tool_from_dict,
    tools_from_list,
)
from voicebot.tools.webhook import WebhookTools, tls_context
from voicebot.transports.realtime_session import RealtimeTranslator

WEATHER = ToolSpec("get_weather", "Current weather in a city.",
                   {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)


@pytest.fixture(scope="module")
def tok(bundle_dir: Callable[[str], str]) -> Any:
    return AutoTokenizer.from_pretrained(bundle_dir("qwen3-tokenizer"))


def token_deltas(tok: Any, text: str) -> list[TextDelta]:
    """``text`` as the engine streams it: one token per delta."""
    return [TextDelta(tok.decode([i]), 1, (i,)) for i in tok.encode(text, add_special_tokens=False)]


# ---------------------------------------------------------------- declarations
def test_tools_are_read_in_the_realtime_and_the_chat_shape() -> None:
    rt_shape = {"type": "function", "name": "get_weather", "description": "d", "parameters": WEATHER.parameters}
    chat_shape = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                                   "parameters": WEATHER.parameters}}
    assert tool_from_dict(rt_shape) == tool_from_dict(chat_shape) == ToolSpec("get_weather", "d", WEATHER.parameters)
    assert tool_from_dict({"type": "mcp", "server_label": "x"}) is None  # not ours to run: skipped
    assert tool_from_dict({"type": "function", "name": "ping"}).parameters == {"type": "object", "properties": {}}
    for bad in ({"type": "function", "name": "no spaces"}, {"type": "function", "name": "f", "parameters": []},
                {"type": "function", "name": "f", "parameters": {"type": "string"}}, "get_weather"):
        with pytest.raises(ToolError):
            tool_from_dict(bad)
    with pytest.raises(ToolError, match="unique"):
        tools_from_list([rt_shape, rt_shape])


def test_tool_choice_forms() -> None:
    assert ToolChoice.parse(None) == ToolChoice("auto")
    assert ToolChoice.parse("required").forces_call()
    named = ToolChoice.parse({"type": "function", "name": "get_weather"})
    assert named == ToolChoice.parse({"type": "function", "function": {"name": "get_weather"}})
    assert named.as_wire() == {"type": "function", "name": "get_weather"}
    named.check([WEATHER])
    with pytest.raises(ToolError):
        ToolChoice("function", "nope").check([WEATHER])
    with pytest.raises(ToolError):
        ToolChoice("required").check([])
    with pytest.raises(ToolError):
        ToolChoice.parse("sometimes")


def test_server_tools_config_is_typed_and_checked() -> None:
    cfg = load_config(None, ["tools.max_rounds=2"])
    assert cfg.tools.server == [] and cfg.llm.tool_parser == "hermes" and cfg.llm.tool_grammar == "always"
    ok = ServerToolConfig(name="get_weather", url="http://127.0.0.1:9/w", parameters=WEATHER.parameters)
    assert ok.timeout_s == 5.0
    with pytest.raises(ValueError):
        ServerToolConfig(name="get weather", url="http://x/")
    with pytest.raises(ValueError):
        ServerToolConfig(name="f", url="ftp://x/")
    with pytest.raises(ConfigError, match="tool_grammar"):
        load_config(None, ["llm.tool_grammar=sometimes"])


# ---------------------------------------------------------- parsing (vLLM's)
def test_vllm_hermes_parser_keeps_markup_out_of_speech(tok: Any) -> None:
    stream = ToolCallStream(tok, "hermes", [WEATHER], ToolChoice())
    pieces = [p for d in token_deltas(tok, "Let me check. " + CALL) for p in stream.feed(d.text, d.token_ids)]
    speech = "".join(p.text for p in pieces if isinstance(p, Speech))
    assert speech.strip() == "Let me check."  # nothing of the call is ever spoken
    assert [p.name for p in pieces if isinstance(p, CallStarted)] == ["get_weather"]
    streamed = "".join(p.delta for p in pieces if isinstance(p, ArgumentsDelta))
    assert json.loads(streamed) == {"city": "Paris"}
    (call,) = stream.finish()
    assert call.valid and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_a_call_cut_short_is_reported_invalid(tok: Any) -> None:
    stream = ToolCallStream(tok, "hermes", [WEATHER], ToolChoice())
    for d in token_deltas(tok, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'):
        stream.feed(d.text, d.token_ids)
    (call,) = stream.finish()
    assert (call.name, call.valid) == ("get_weather", False)


def test_plain_replies_pass_through_whole(tok: Any) -> None:
    stream = ToolCallStream(tok, "hermes", [], ToolChoice())
    text = "It is 3 < 4, and x<y too."
    pieces = [p for d in token_deltas(tok, text) for p in stream.feed(d.text, d.token_ids)]
    assert "".join(p.text for p in pieces if isinstance(p, Speech)) == text
    assert stream.finish() == []


def test_constraints_per_tool_choice(tok: Any) -> None:
    def tag(choice: ToolChoice, mode: str = "always") -> dict[str, Any] | None:
        c = constraint_for(tok, "hermes", [WEATHER], choice, mode)  # type: ignore[arg-type]
        return json.loads(c.structural_tag) if c.structural_tag else None

    auto = tag(ToolChoice("auto"))
    assert auto is not None and auto["format"]["type"] == "or"
    call, text = auto["format"]["elements"]  # a call from the first token, or text that may call later
    assert call["type"] == "tags_with_separator" and call["stop_after_first"] is True
    triggered = text["elements"][1]
    assert triggered["triggers"] == ["<tool_call>"]
    assert triggered["stop_after_first"] is True  # one call per reply
    schema = triggered["tags"][0]["content"]["json_schema"]
    assert schema == WEATHER.parameters  # the arguments are held to the declared schema
    required = tag(ToolChoice("required"))
    assert required is not None and required["format"]["at_least_one"] is True
    named = tag(ToolChoice("function", "get_weather"))
    assert named is not None and all("get_weather" in t["begin"] for t in named["format"]["tags"])
    assert tag(ToolChoice("auto"), "forced") is None and tag(ToolChoice("required"), "forced") is not None
    assert tag(ToolChoice("required"), "off") is None
    none = constraint_for(tok, "hermes", [WEATHER], ToolChoice("none"), "always")
    assert none.structural_tag is not None and "tool_call" not in none.structural_tag  # text only
    assert none.logit_bias == {tok.convert_tokens_to_ids("<tool_call>"): -100.0}
    assert constraint_for(tok, "hermes", [], ToolChoice("auto"), "always").sampling_kwargs() == {}
    # With tools in the prompt vLLM must keep <tool_call> in the text, grammar or not.
    assert constraint_for(tok, "hermes", [WEATHER], ToolChoice("auto"), "off").sampling_kwargs() == {
        "skip_special_tokens": False}
    assert none.sampling_kwargs()["skip_special_tokens"] is False


def test_auto_grammar_takes_calls_only_with_their_tag(tok: Any) -> None:
    """Qwen2.5-Coder-0.5B wrote calls as bare JSON (no <tool_call>): never parsed as a call,
    read out loud instead. The auto grammar now refuses a reply opening like JSON."""
    import xgrammar as xgr

    tag = constraint_for(tok, "hermes", [WEATHER], ToolChoice("auto"), "always").structural_tag
    assert tag is not None
    grammar = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok)).compile_structural_tag(tag)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))

    assert not accepts('{"name": "get_weather", "arguments": {"city": "Paris"}}')  # bare JSON
    assert not accepts('```json\n{"name": "get_weather"') and not accepts('Sure: {"name": "get_weather"')
    assert accepts(CALL) and accepts("Let me check. " + CALL) and accepts("It is sunny, 21 degrees.")
    assert not accepts('<tool_call>\n{"name": "tell_joke"')  # only declared tools
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city":     "Paris"}}')  # bounded


# ------------------------------------------------------- a reply with a call
class FakeLlm:
    def __init__(self, deltas: list[TextDelta]) -> None:
        self.deltas = deltas
        self.kwargs: dict[str, Any] = {}

    async def generate(self, prompt_ids: list[int], **kwargs: Any) -> AsyncGenerator[TextDelta, None]:
        self.kwargs = kwargs
        for d in self.deltas:
            await asyncio.sleep(0)
            yield d


class FakeTts:
    sample_rate = 16000

    def __init__(self) -> None:
        self.said: list[str] = []

    async def synthesize(self, text: str, *, voice: str | None = None,
                         speed: float | None = None, ahead_s: float = 0.0) -> AsyncGenerator[np.ndarray, None]:
        self.said.append(text)
        yield np.full(160, 0.1, np.float32)


async def test_a_reply_speaks_around_its_call_and_streams_the_call(tok: Any) -> None:
    tts = FakeTts()
    llm = FakeLlm(token_deltas(tok, "Sure, one moment. " + CALL))
    constraint = constraint_for(tok, "hermes", [WEATHER], ToolChoice(), "always")
    resp = Response("resp_1", "item_1", [1], llm, tts, voice=None, speed=None, max_tokens=64,  # type: ignore[arg-type]
                    first_clause_words=3, max_clause_words=12, gated=False,
                    tool_stream=ToolCallStream(tok, "hermes", [WEATHER], ToolChoice()), constraint=constraint)
    await resp.run()
    assert "structured_outputs" in llm.kwargs  # the grammar went to vLLM with the request
    spoken = " ".join(tts.said)
    assert "Sure" in spoken and "tool_call" not in spoken and "get_weather" not in spoken and "{" not in spoken
    assert resp.full_text == "Sure, one moment."
    assert resp.raw_text.endswith(CALL)  # the history keeps the call as generated
    (call,) = resp.tool_calls
    assert (call.name, json.loads(call.arguments), call.valid) == ("get_weather", {"city": "Paris"}, True)
    events = []
    while (d := resp.deltas.get_nowait()) is not None:
        events.append(d)
    kinds = [type(e).__name__ for e in events if not isinstance(e, str)]
    assert kinds[0] == "ToolCallStarted" and kinds[-1] == "ToolCallDone" and "ToolCallArgumentsDelta" in kinds
    assert json.loads("".join(e.delta for e in events if isinstance(e, se.ToolCallArgumentsDelta))) == {"city": "Paris"}


# ------------------------------------------------------------- session plans
def server_config(url: str = "http://127.0.0.1:9/w", **tools: Any) -> Config:
    cfg = load_config(None, [])
    cfg.tools = cfg.tools.model_copy(update={"server": [ServerToolConfig(
        name="get_weather", url=url, parameters=WEATHER.parameters, timeout_s=tools.pop("timeout_s", 5.0))],
        **tools})
    return cfg


def test_server_tool_rounds_end_in_an_answer(tok: Any) -> None:
    cfg = server_config(max_rounds=2, tool_choice="required")
    native = SessionTools(cfg, tok, "native")
    assert [t.name for t in native.tools] == ["get_weather"]
    plans = [native.plan(ResponseOptions(), r).choice.mode for r in range(3)]
    assert plans == ["required", "auto", "none"]  # forced once, then free, then must answer
    assert native.plan(ResponseOptions(), 1, after_result=True).choice.mode == "none"  # answer the result
    assert native.plan(ResponseOptions(tool_choice=ToolChoice("auto")), 1, after_result=True).choice.mode == "auto"
    call = [ToolCall("c1", "i1", "get_weather", '{"city": "Paris"}')]
    assert native.runs(call, 0) and native.runs(call, 1) and not native.runs(call, 2) and not native.runs([], 0)
    realtime = SessionTools(cfg, tok, "realtime")  # Realtime clients bring their own tools
    assert realtime.tools == [] and realtime.runner is None and not realtime.runs(call, 0)
    realtime.set([WEATHER], ToolChoice("function", "get_weather"))
    override = realtime.plan(ResponseOptions(tools=[], tool_choice=ToolChoice("auto")))
    assert override.tools == [] and override.prompt_tools == []
    with pytest.raises(ToolError):
        realtime.plan(ResponseOptions(tool_choice=ToolChoice("function", "other")))
    assert native.clip("x" * 5000).endswith("[truncated]") and len(native.clip("x" * 5000)) < 4100


# ------------------------------------------------------------------ webhooks
@pytest.fixture
async def webhook_server() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    async def weather(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({**body, "auth": request.headers.get("Authorization")})
        return web.json_response({"city": body["arguments"]["city"], "temp_c": 21, "sky": "sunny"})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async with serve_routes([web.post("/weather", weather), web.post("/slow", slow), web.post("/broken", broken)]) as base:
        yield base, seen


async def test_webhooks_answer_or_give_the_model_an_error(webhook_server: tuple[str, list[dict[str, Any]]]) -> None:
    base, seen = webhook_server

    def tool(path: str, **kw: Any) -> ServerToolConfig:
        return ServerToolConfig(name=path.strip("/"), url=base + path, parameters=WEATHER.parameters, **kw)

    hooks = WebhookTools([tool("/weather", headers={"Authorization": "Bearer k"}), tool("/slow", timeout_s=0.3),
                          tool("/broken"), ServerToolConfig(name="gone", url="http://127.0.0.1:9/x", timeout_s=2)])

    def call(name: str, args: str = '{"city": "Paris"}') -> ToolCall:
        return ToolCall("call_1", "item_1", name, args)

    ok = json.loads(await hooks.run(call("weather"), "sess_1"))
    assert ok == {"city": "Paris", "temp_c": 21, "sky": "sunny"}
    assert seen == [{"name": "weather", "arguments": {"city": "Paris"}, "call_id": "call_1",
                     "session_id": "sess_1", "auth": "Bearer k"}]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    slow = json.loads(await hooks.run(call("slow"), "sess_1"))
    assert "did not answer within 0.3 s" in slow["error"] and loop.time() - t0 < 4.5  # never a hung call (5 s)
    assert "HTTP 500" in json.loads(await hooks.run(call("broken"), "s"))["error"]
    assert "could not be reached" in json.loads(await hooks.run(call("gone"), "s"))["error"]
    assert "no tool named" in json.loads(await hooks.run(call("nope"), "s"))["error"]
    assert "invalid arguments" in json.loads(await hooks.run(call("weather", "[1"), "s"))["error"]

    task = asyncio.create_task(hooks.run(call("slow"), "s"))  # a barge-in cancels the request
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_webhook_call_loads_no_ca_bundle_on_the_event_loop(
    webhook_server: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # httpx loads certifi's CA bundle for every client it builds (~45 ms of CPU): on the
    # loop, at each tool call, every call on the server stalled with it.
    base, _ = webhook_server
    loop_thread = threading.get_ident()
    loads: list[int] = []
    real_load = ssl.SSLContext.load_verify_locations

    def spy(self: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(threading.get_ident())
        real_load(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", spy)
    tls_context.cache_clear()  # an earlier test may have built it
    hooks = WebhookTools([ServerToolConfig(name="weather", url=base + "/weather", parameters=WEATHER.parameters)])
    for _ in range(2):
        assert json.loads(await hooks.run(ToolCall("call_1", "item_1", "weather", '{"city": "Oslo"}'), "s"))["city"] == "Oslo"
    assert len(loads) == 1, f"the CA bundle is loaded once, not per call: {len(loads)} loads"
    assert loop_thread not in loads, "the CA bundle was loaded on the event loop"


# ------------------------------------------------------------- Realtime wire
class ToolSession:
    """The translator's session port, recording the tool calls it gets."""

    def __init__(self) -> None:
        self.settings = SessionSettings(system_prompt="Be brief.")
        self.conversation = self
        self.input_ms = 0.0
        self.budget_tokens = 1024
        self.token_count = 100
        self.calls: list[tuple[Any, ...]] = []

    def set_tools(self, tools: list[ToolSpec] | None = None, choice: ToolChoice | None = None) -> None:
        if choice is not None:
            choice.check(tools or [])
        self.calls.append(("tools", tools, choice))

    def add_tool_result(self, call_id: str, output: str, item_id: str | None = None) -> str:
        self.calls.append(("result", call_id, output))
        return item_id or "item_out1"

    def add_tool_call(self, call_id: str, name: str, arguments: dict[str, object], item_id: str | None = None) -> str:
        self.calls.append(("call", call_id, name, arguments))
        return item_id or "item_fc9"

    def create_response(self, options: ResponseOptions | None = None) -> str:
        self.calls.append(("respond", options))
        return "resp_1"

    def update_settings(self, **changes: object) -> None:
        self.settings = SessionSettings.model_validate({**self.settings.model_dump(), **{
            k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in changes.items()}})

    def delete(self, item_id: str) -> bool:
        return False


def send(tr: RealtimeTranslator, **event: Any) -> list[dict[str, Any]]:
    return tr.client_message(json.dumps(event))


def checked(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every event must parse as the openai SDK's own server event type."""
    for e in events:
        if e["type"] != "rate_limits.updated":
            SERVER_EVENT.validate_python(e)
    return events


def test_session_tools_reach_the_session_and_are_echoed() -> None:
    fake = ToolSession()
    tr = RealtimeTranslator(fake, session_id="sess_1", model="m")  # type: ignore[arg-type]
    tool = {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": WEATHER.parameters}
    (ev,) = checked(send(tr, type="session.update", session={"type": "realtime", "tools": [tool],
                                                              "tool_choice": "required"}))
    assert ev["type"] == "session.updated" and ev["session"]["tools"] == [tool]
    assert ev["session"]["tool_choice"] == "required"
    (_, tools, choice) = fake.calls[-1]
    assert tools == [ToolSpec("get_weather", "Weather.", WEATHER.parameters)] and choice == ToolChoice("required")
    # A named function that is not declared: a clear error, the session goes on.
    (err,) = send(tr, type="session.update", session={"tool_choice": {"type": "function", "name": "nope"}})
    assert err["type"] == "error" and err["error"]["param"] == "session.tool_choice"
    (err,) = send(tr, type="session.update", session={"tools": [{"type": "function", "name": "bad name"}]})
    assert err["type"] == "error" and err["error"]["param"] == "session.tools"


def test_response_create_overrides_are_parsed_and_applied() -> None:
    fake = ToolSession()
    tr = RealtimeTranslator(fake, session_id="sess_1", model="m")  # type: ignore[arg-type]
    assert send(tr, type="response.create", response={
        "instructions": "Answer in French.", "max_output_tokens": 20, "tool_choice": "none",
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER.parameters}]}) == []
    (_, options) = fake.calls[-1]
    assert options == ResponseOptions(instructions="Answer in French.", tools=[ToolSpec("get_weather", "",
                                      WEATHER.parameters)], tool_choice=ToolChoice("none"), max_tokens=20)
    send(tr, type="response.create", response={"metadata": {"a": "b"}, "max_output_tokens": "inf"})
    assert fake.calls[-1] == ("respond", None)  # nothing to override
    (err,) = send(tr, type="response.create", response={"max_output_tokens": 0})
    assert err["error"]["param"] == "response.max_output_tokens"


@pytest.mark.parametrize("beta", [False, True])
def test_a_call_streams_as_a_function_call_item_and_its_result_comes_back(beta: bool) -> None:
    fake = ToolSession()
    tr = RealtimeTranslator(fake, session_id="sess_1", model="m", beta=beta)  # type: ignore[arg-type]
    send(tr, type="session.update", session={"tools": [WEATHER.as_realtime()]})
    out = tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    assert [e["type"] for e in out if e["type"] != "rate_limits.updated"] == ["response.created"]
    out += tr.session_event(se.ToolCallStarted("resp_1", "item_a1_fc0", "call_1", "get_weather"))
    for piece in ('{"city": ', '"Paris"}'):
        out += tr.session_event(se.ToolCallArgumentsDelta("resp_1", "item_a1_fc0", "call_1", piece))
    call = ToolCall("call_1", "item_a1_fc0", "get_weather", '{"city": "Paris"}')
    out += tr.session_event(se.ToolCallDone("resp_1", call))
    out += tr.session_event(se.ResponseDone("resp_1", "item_a1", "completed", "", "", 0, "stop", 50, 20, (call,)))
    if not beta:
        checked(out)
    kinds = [e["type"] for e in out if e["type"] != "rate_limits.updated"]
    added = "conversation.item.created" if beta else "conversation.item.added"
    assert kinds[:3] == ["response.created", "response.output_item.added", added]
    assert kinds.count("response.function_call_arguments.delta") == 2
    done = next(e for e in out if e["type"] == "response.function_call_arguments.done")
    assert (done["call_id"], done["name"], json.loads(done["arguments"])) == ("call_1", "get_weather", {"city": "Paris"})
    assert done["output_index"] == 0  # no message item before it: the reply only called
    (item,) = next(e for e in out if e["type"] == "response.done")["response"]["output"]
    assert item == {"id": "item_a1_fc0", "object": "realtime.item", "type": "function_call", "status": "completed",
                    "name": "get_weather", "call_id": "call_1", "arguments": '{"city": "Paris"}'}
    assert "response.output_audio_transcript.done" not in kinds and "response.audio_transcript.done" not in kinds
    # The client runs the tool and sends its result, then asks for the answer.
    got = send(tr, type="conversation.item.create", item={"type": "function_call_output", "call_id": "call_1",
                                                          "output": '{"temp_c": 21}'})
    if not beta:
        checked(got)
    assert got[0]["item"]["type"] == "function_call_output" and got[0]["item"]["call_id"] == "call_1"
    assert fake.calls[-1] == ("result", "call_1", '{"temp_c": 21}')
    send(tr, type="response.create")
    assert fake.calls[-1] == ("respond", None)


def test_speech_then_a_call_gives_two_output_items() -> None:
    fake = ToolSession()
    tr = RealtimeTranslator(fake, session_id="sess_1", model="m")  # type: ignore[arg-type]
    send(tr, type="session.update", session={"tools": [WEATHER.as_realtime()]})
    out = tr.session_event(se.ResponseStarted("resp_1", "item_a1"))
    out += tr.session_event(se.ResponseTextDelta("resp_1", "item_a1", "One moment."))
    out += tr.session_event(se.ToolCallStarted("resp_1", "item_a1_fc0", "call_1", "get_weather"))
    call = ToolCall("call_1", "item_a1_fc0", "get_weather", '{"city": "Paris"}')
    out += tr.session_event(se.ToolCallDone("resp_1", call))
    out += tr.session_event(se.ResponseDone("resp_1", "item_a1", "completed", "One moment.", "One moment.", 0,
                                            "stop", 5, 5, (call,)))
    checked(out)
    output = next(e for e in out if e["type"] == "response.done")["response"]["output"]
    assert [i["type"] for i in output] == ["message", "function_call"]
    fc_added = [e for e in out if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in fc_added] == [0, 1]
    # A client-side function_call item (a client replaying history) goes to the session too.
    got = send(tr, type="conversation.item.create", item={"type": "function_call", "call_id": "call_7",
                                                          "name": "get_weather", "arguments": '{"city": "Oslo"}'})
    checked(got)
    assert fake.calls[-1] == ("call", "call_7", "get_weather", {"city": "Oslo"})
    (err,) = send(tr, type="conversation.item.create", item={"type": "function_call_output", "output": "x"})
    assert err["error"]["param"] == "item.call_id"


# ------------------------------------------------- the session's tool loop (fakes)
async def test_a_server_tool_round_in_a_session(
    tok: Any, webhook_server: tuple[str, list[dict[str, Any]]]
) -> None:
    """Fake engines (tests/fakes.py) and a real local webhook: the call is run, the filler
    is said while it is slow, the result goes into the history, the model answers; a
    model that calls again and again is stopped after tools.max_rounds."""
    from fakes import FakeLlm, make_engines

    from voicebot.session.clock import REAL_CLOCK
    from voicebot.session.session import Session

    base, seen = webhook_server

    class ScriptedLlm(FakeLlm):
        script: list[str] = []
        kwargs: list[dict[str, Any]] = []

        async def generate(self, prompt_ids: list[int], **kw: Any) -> AsyncGenerator[TextDelta, None]:  # type: ignore[override]
            self.kwargs.append(kw)
            self.reply = self.script.pop(0) if self.script else "It is sunny."
            async for d in super().generate(prompt_ids, **kw):
                yield d

    engines = make_engines(tok, clock=REAL_CLOCK, word_delay=0.001)
    llm = ScriptedLlm(tok, clock=REAL_CLOCK, word_delay=0.001)
    engines.llm = llm  # type: ignore[assignment]
    engines.cfg = server_config(max_rounds=2, filler_after_ms=100)
    engines.cfg.tools.server = [ServerToolConfig(name="get_weather", url=f"{base}/weather",
                                                 parameters=WEATHER.parameters)]
    call_words = CALL.replace("\n", " \n ")  # the fake streams word by word
    llm.script[:] = [call_words, "It is 21 degrees and sunny in Paris."]
    session = Session(engines, SessionSettings.from_config(engines.cfg), transport="native")
    events: list[Any] = []

    async def collect() -> None:
        async for e in session.events():
            events.append(e)

    async def ask(text: str, done: int) -> None:
        """The caller's text, a reply, and its tool rounds until ``done`` replies in all."""
        session.add_text("user", text)
        session.create_response()
        async with asyncio.timeout(10):
            while len([e for e in events if isinstance(e, se.ResponseDone)]) < done:
                await asyncio.sleep(0.01)

    async with session:
        reader = asyncio.create_task(collect())
        await ask("What's the weather in Paris?", 2)
        first, second = [e for e in events if isinstance(e, se.ResponseDone)]
        (call,) = first.tool_calls
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        (result,) = [e for e in events if isinstance(e, se.ToolResult)]
        assert json.loads(result.output)["temp_c"] == 21 and seen[-1]["arguments"] == {"city": "Paris"}
        assert first.text == "" and second.text == "It is 21 degrees and sunny in Paris." and not second.tool_calls
        assert "structured_outputs" in llm.kwargs[0] and llm.kwargs[0]["skip_special_tokens"] is False
        roles = [m.role for m in session.conversation.messages]
        assert roles == ["user", "assistant", "tool", "assistant"]
        assert "<tool_call>" in session.conversation.messages[1].content  # kept as generated
        assert session.conversation.messages[2].call_id == call.call_id

        # The reply after a result may not call (tools.answer_after_result): a model that
        # calls anyway gets a text-only grammar and the <tool_call> ban, and is not run.
        assert "logit_bias" in llm.kwargs[1] and "structured_outputs" in llm.kwargs[1]
        llm.script[:] = [call_words] * 5
        runs_before = len(seen)
        await ask("And in Paris again?", 4)
        await asyncio.sleep(0.2)
        assert len(seen) - runs_before == 1
        assert "logit_bias" in llm.kwargs[-1]  # the last reply may not start a call
        assert len([e for e in events if isinstance(e, se.ResponseDone)]) == 4

        # Without that rule, tools.max_rounds stops a model that calls every time.
        engines.cfg.tools.answer_after_result = False
        session.tools._cfg = engines.cfg.tools
        llm.script[:] = [call_words] * 5
        runs_before = len(seen)
        await ask("And once more?", 7)
        await asyncio.sleep(0.2)
        assert len(seen) - runs_before == 2 and "logit_bias" in llm.kwargs[-1]
        assert len([e for e in events if isinstance(e, se.ResponseDone)]) == 7
        reader.cancel()


async def test_realtime_required_forces_a_turns_first_reply_and_lets_the_result_be_answered(tok: Any) -> None:
    """A Realtime client's tool_choice "required" (what the Agents SDK test sets): the
    reply to a user turn must call; the reply the client asks for after its
    function_call_output answers (else the SDK would call the tool forever); the next
    user turn is forced again."""
    from fakes import FakeLlm, make_engines

    from voicebot.session.clock import REAL_CLOCK
    from voicebot.session.session import Session

    class ScriptedLlm(FakeLlm):
        script: list[str] = []

        async def generate(self, prompt_ids: list[int], **kw: Any) -> AsyncGenerator[TextDelta, None]:  # type: ignore[override]
            self.reply = self.script.pop(0)
            async for d in super().generate(prompt_ids, **kw):
                yield d

    engines = make_engines(tok, clock=REAL_CLOCK, word_delay=0.001)
    llm = ScriptedLlm(tok, clock=REAL_CLOCK, word_delay=0.001)
    engines.llm = llm  # type: ignore[assignment]
    llm.script[:] = [CALL.replace("\n", " \n "), "It is 13 degrees.", CALL.replace("\n", " \n ")]
    session = Session(engines, SessionSettings.from_config(engines.cfg), transport="realtime")
    events: list[Any] = []
    choices: list[str] = []

    async def collect() -> None:
        async for e in session.events():
            events.append(e)

    async def reply(done: int) -> None:
        session.create_response()
        assert session.speaker.live is not None
        choices.append(session.speaker.live.tool_choice.mode)
        async with asyncio.timeout(10):
            while len([e for e in events if isinstance(e, se.ResponseDone)]) < done:
                await asyncio.sleep(0.01)

    async with session:
        reader = asyncio.create_task(collect())
        session.set_tools([WEATHER], ToolChoice("required"))
        session.add_text("user", "What's the weather in Paris?")
        await reply(1)
        (call,) = [e for e in events if isinstance(e, se.ResponseDone)][0].tool_calls
        session.add_tool_result(call.call_id, "It is foggy and 13 degrees in Paris.")
        await reply(2)
        session.add_text("user", "And in Oslo?")
        await reply(3)
        reader.cancel()
    assert choices == ["required", "none", "required"]
    assert [e for e in events if isinstance(e, se.ResponseDone)][1].text == "It is 13 degrees."


async def test_a_slow_server_tool_is_an_error_result_and_the_filler_is_said(
    tok: Any, webhook_server: tuple[str, list[dict[str, Any]]]
) -> None:
    from fakes import FakeLlm, make_engines

    from voicebot.session.clock import REAL_CLOCK
    from voicebot.session.session import Session

    base, _ = webhook_server
    engines = make_engines(tok, clock=REAL_CLOCK, word_delay=0.001)
    llm = FakeLlm(tok, clock=REAL_CLOCK, word_delay=0.001, reply=CALL.replace("get_weather", "slow"))
    engines.llm = llm  # type: ignore[assignment]
    engines.cfg = server_config(filler_after_ms=100)
    engines.cfg.tools.server = [ServerToolConfig(name="slow", url=f"{base}/slow", parameters=WEATHER.parameters,
                                                 timeout_s=0.5)]
    session = Session(engines, SessionSettings.from_config(engines.cfg), transport="twilio")
    events: list[Any] = []

    async def collect() -> None:
        async for e in session.events():
            events.append(e)

    async with session:
        reader = asyncio.create_task(collect())
        session.add_text("user", "What's the weather in Paris?")
        session.create_response()
        async with asyncio.timeout(10):
            while not [e for e in events if isinstance(e, se.ToolResult)]:
                await asyncio.sleep(0.01)
        (result,) = [e for e in events if isinstance(e, se.ToolResult)]
        assert "did not answer within 0.5 s" in json.loads(result.output)["error"]
        first = next(e for e in events if isinstance(e, se.ResponseDone))
        assert first.text == "" and first.played_ms > 0  # the filler was heard while it waited
        assert engines.tts.started >= 1  # type: ignore[attr-defined]
        reader.cancel()


def test_tool_preload_skips_grammar_modules_an_older_vllm_lacks(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    # vLLM 0.26 (the GPU machines') has no tool_strict_level: a frontend must still start.
    from voicebot.tools import preload

    monkeypatch.setattr(preload, "TOOL_MODULES", ("json", "voicebot_no_such_module.inner"))
    preload.preload_tools("hermes")
    assert "voicebot_no_such_module.inner is not in this vLLM" in caplog.text
    with pytest.raises(KeyError):
        preload.preload_tools("no_such_parser")
