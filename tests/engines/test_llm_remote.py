"""The remote LLM tier's client (voicebot/engines/llm/remote.py): what a reply sends and
reads on the wire, and the tier's health: requests failed in a row mark it down, but not a
timeout that fired while this frontend's own event loop was late for most of the wait (the
tier's answer may have sat unread meanwhile).

The engine's real HTTP client against real sockets on this host: a tier that takes the
connection and never answers (each request times out waiting for its first token) and a
port nobody listens on (refused at once); the loop watch is a fake of our own
LoopLateness: it says whether the loop was late, as the real one reads its ticks
(tests/runtime/test_loop_lag.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from fakes import FakeLoopWatch
from llm_tier import free_port
from servers import serve_routes

from voicebot.config import LlmConfig, RemoteLlmConfig
from voicebot.engines.contracts import GenerationStats, Lane, TextDelta
from voicebot.engines.llm.remote import RemoteLlmEngine, RemoteLlmError

THRESHOLD = 3
FIRST_TOKEN_S = 0.1  # a silent tier's requests time out after this


@contextlib.asynccontextmanager
async def silent_tier() -> AsyncIterator[str]:
    """A tier that takes every connection and never answers: its requests time out."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def closed_port() -> str:
    """A tier nobody listens on: its requests are refused at once."""
    return f"http://127.0.0.1:{free_port()}"


@contextlib.asynccontextmanager
async def tier(url: str, loop: FakeLoopWatch | None) -> AsyncIterator[RemoteLlmEngine]:
    """An engine on ``url`` with its real client (no retries), as start() leaves it."""
    cfg = LlmConfig(backend="remote", remote=RemoteLlmConfig(
        url=url, retries=0, failure_threshold=THRESHOLD, first_token_timeout_s=FIRST_TOKEN_S))
    engine = RemoteLlmEngine(cfg, "unused-tokenizer", loop=loop)
    # What start() sets once the tier lists its model (it would load a tokenizer first).
    engine._client = engine._engine = engine._new_client()
    engine._model = "m"
    try:
        yield engine
    finally:
        await engine.aclose()


async def fail_requests(engine: RemoteLlmEngine, n: int) -> None:
    for i in range(n):
        st = GenerationStats(f"r{i}", Lane.INTERACTIVE)
        with pytest.raises(RemoteLlmError):
            async for _ in engine._stream(f"r{i}", [1, 2, 3], Lane.INTERACTIVE, st, {}):
                pass


async def test_timeouts_mark_the_tier_down() -> None:
    async with silent_tier() as url, tier(url, FakeLoopWatch(late=False)) as engine:
        await fail_requests(engine, THRESHOLD)
        assert engine.dead_reason is not None and "3 requests failed in a row" in engine.dead_reason


async def test_timeouts_while_our_loop_was_late_do_not() -> None:
    loop = FakeLoopWatch(late=True)
    async with silent_tier() as url, tier(url, loop) as engine:
        await fail_requests(engine, THRESHOLD * 2)
        assert engine.dead_reason is None and engine.late_loop_failures == THRESHOLD * 2
        assert loop.asked == THRESHOLD * 2
        loop.late = False  # the loop keeps up again, the tier still does not answer: now it is the tier's
        await fail_requests(engine, THRESHOLD)
        assert engine.dead_reason is not None


async def test_a_refused_connection_is_the_tiers_however_late_our_loop() -> None:
    loop = FakeLoopWatch(late=True)
    async with tier(closed_port(), loop) as engine:
        await fail_requests(engine, THRESHOLD)
        assert engine.dead_reason is not None and loop.asked == 0


async def test_without_a_loop_watch_every_timeout_counts() -> None:
    async with silent_tier() as url, tier(url, None) as engine:
        await fail_requests(engine, THRESHOLD)
        assert engine.dead_reason is not None


async def test_a_start_whose_warm_up_fails_closes_its_own_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier lists its model, then refuses the start-up's sampled replies: start() fails
    with that error and closes the HTTP client it opened, whoever called it (start_all
    closes engines too, but a caller that starts one engine alone must not leak its pool)."""
    from voicebot.engines.llm import remote

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=500, text="the tier refused it")

    opened: list[aiohttp.ClientSession] = []
    new_client = RemoteLlmEngine._new_client

    def client(self: RemoteLlmEngine) -> aiohttp.ClientSession:
        opened.append(new_client(self))
        return opened[-1]

    monkeypatch.setattr(RemoteLlmEngine, "_new_client", client)
    monkeypatch.setattr(remote, "load_tokenizer", lambda path: FakeTokenizer())
    async with serve_routes([web.get("/v1/models", models), web.post("/v1/completions", refuse)]) as url:
        cfg = LlmConfig(backend="remote", warm_sampling_rows=2, remote=RemoteLlmConfig(url=url, retries=0))
        engine = RemoteLlmEngine(cfg, "unused-tokenizer")
        with pytest.raises(RemoteLlmError, match="500"):
            await engine.start()
    assert len(opened) == 1 and opened[0].closed
    assert engine.dead_reason == "not started"


async def test_a_reply_crosses_the_wire_as_the_tier_expects_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """What reaches the tier (behind a proxy's path prefix): the bearer key, the session's
    affinity header, the prompt's token ids with the stream options; what comes back: the
    text and token ids chunk by chunk, then the usage block's cached tokens."""
    from voicebot.affinity import bind_session
    from voicebot.engines.llm import remote

    seen: list[tuple[str, dict[str, str], dict[str, object]]] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "served"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, dict(request.headers), await request.json()))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text, ids in (("Hello", [11]), (" there.", [12, 13])):
            chunk = {"choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}
        await resp.write(f": a comment\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    monkeypatch.setenv("VOICEBOT_LLM_API_KEY", "sk-test")
    monkeypatch.setattr(remote, "load_tokenizer", lambda path: FakeTokenizer())
    async with serve_routes([web.get("/tier/v1/models", models), web.post("/tier/v1/completions", completions)]) as url:
        engine = RemoteLlmEngine(LlmConfig(backend="remote", remote=RemoteLlmConfig(url=f"{url}/tier/")),
                                 "unused-tokenizer")
        try:
            await engine.start()
            assert engine.model == "served"
            st = GenerationStats("r1", Lane.INTERACTIVE)

            async def call() -> list[TextDelta]:  # a call's own task, as a session's reply runs
                bind_session("call-1")
                return [d async for d in engine.generate([1, 2, 3], max_tokens=8, stats=st)]

            deltas = await asyncio.create_task(call())
        finally:
            await engine.aclose()
    assert [(d.text, d.token_ids) for d in deltas] == [("Hello", (11,)), (" there.", (12, 13))]
    assert st.output_tokens == 3 and st.prompt_tokens == 3 and st.cached_tokens == 2 and st.ttft_s is not None
    [(path, headers, body)] = seen
    assert path == "/tier/v1/completions"
    assert headers["Authorization"] == "Bearer sk-test" and headers["X-Session-ID"] == "call-1"
    assert body["prompt"] == [1, 2, 3] and body["model"] == "served" and body["max_tokens"] == 8
    assert body["stream"] is True and body["return_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True} and "priority" in body


class FakeTokenizer:
    """What the engine asks of a tokenizer at start and to render the warm-up's prompt."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1, 2, 3]

    def apply_chat_template(self, messages: object, **kwargs: object) -> list[int]:
        return [1, 2, 3]
